"""A fleet of kvstore nodes on one bucket, with no service besides the bucket.

- :mod:`view`: the members as a node or a client sees them, and the one
  placement (rendezvous hashing over the alive nodes' URLs, the client's).
- :mod:`membership`: the small interface a membership backend implements;
  :mod:`bucket` implements it with objects in the bucket and conditional
  writes (an etcd lease or a Kubernetes Lease could stand in).
- :mod:`node`: a daemon's part: join, heartbeat, watch the others, fence
  itself when it cannot prove it is alive.
- :mod:`registry`: the tenant registry shared by the fleet (every change a
  conditional write of one object, redone on conflict).
- :mod:`identity`: the node's id (kept in the data directory) and URL.
- :mod:`metrics`: the fleet's gauges in ``/metrics`` (members, fenced,
  blocks taken over), kept by the node's writer.
"""
