"""Transports that serve the store: HTTP today; RDMA and GDS where hardware allows."""
