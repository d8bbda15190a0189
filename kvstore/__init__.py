"""kvstore: a storage engine and daemon for LLM KV-cache blocks.

The tree shows the architecture:

- ``engine/``: the storage engine. ``format`` (bytes on disk), ``codec``
  (zstd, byte planes), ``crypto`` (AES-GCM, key wrapping), ``record``,
  ``segment`` and ``segcache`` (files), ``lifecycle`` (a segment's states and
  leases), ``appender`` (group commit, one owner per open segment), ``index``
  (LMDB), ``registry`` (tenants and their keys), ``recovery``, ``compactor``,
  ``retention`` and ``access`` (quotas, TTL, LRU), ``reader`` (the read path),
  ``verify`` (scrub), and ``store``, which puts them together.
- ``tier/``: the object tier (G4). ``base`` (the protocol), one module per
  backend (``local``, ``s3``), ``layout`` (object names), ``mirror`` (uploads),
  ``remote`` (reads from the tier), ``space`` and ``tiering`` (local space,
  eviction, rehydration).
- ``transport/``: how bytes leave the daemon. HTTP (``http/``: the app and
  its middleware, request bodies, RFC 9110 ranges, forwarding between
  workers, the connection layer, ``routes/``), the S3 gateway's HTTP
  (``s3/``), NIXL (``nixl/``), the batch framing.
- ``buckets/``: the S3 gateway's lasting state: its SQLite catalog of
  buckets, objects and uploads, kept as record blocks of the tenants and
  rebuilt from them (``catalog``, ``records``, ``recovery``, ``objects``).
- At the top: what every part shares (``errors``, ``config``, ``metrics``,
  ``names``, ``redaction``), the daemon's own (``server_config``,
  ``sdnotify``, ``tuning``, ``workers``: how many processes ``auto`` starts)
  and the offline checker (``fsck``).
"""

__version__ = "0.1.0"
