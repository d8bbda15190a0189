"""NIXL bulk transfers: remote clients READ blocks from the daemon's agent
and the daemon READs their writes, one-sided, over UCX (RDMA verbs where
there is a NIC, TCP otherwise).

- ``devices``: the RDMA devices pyverbs finds, for the status and for UCX;
- ``agent``: the daemon's NIXL agent (progress thread, UCX devices);
- ``memory``: registered memory: segment mappings and staging buffers;
- ``service``: peers, leases, reads and writes (``/v1/xfer/*`` in
  ``kvstore.transport.http.routes.xfer``).
"""
