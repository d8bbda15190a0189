"""kvstore: a storage engine and daemon for LLM KV-cache blocks.

The tree shows the architecture (ARCHITECTURE.md draws the layers and
follows a PUT, a GET and a segment through them):

- ``engine/``: the storage engine. ``format`` (bytes on disk), ``codec``
  (zstd, byte planes), ``crypto`` (AES-GCM, key wrapping), ``record``,
  ``segment`` and ``segcache`` (files), ``directio`` (O_DIRECT writes),
  ``lifecycle`` (a segment's phases and leases), ``appender`` (group commit,
  one owner per open segment), ``index`` (LMDB), ``registry`` (tenants and
  their keys), ``recovery``, ``compactor``, ``retention``, ``eviction`` and
  ``access`` (quotas, TTL, which blocks a quota evicts), ``admission`` (``admit_after``: a block stored at
  its N-th offer), ``reserve`` (room for removals on a full disk),
  ``reader``, ``verified`` and ``decoded`` (the read path and its caches),
  ``verify`` (scrub), the object tier's engine side (``object_tier``,
  ``layout``, ``mirror``, ``remote``, ``space``, ``residency``), and
  ``store`` with its parts (``store_core``, ``store_read``, ``store_write``,
  ``store_write_plans``, ``store_tenants``, ``store_maintenance``,
  ``store_sealing`` (``seal_after_s``: open segments sealed by age)); other
  packages import it only through ``api``.
- ``tier/``: the object tier's backends (G4), leaves: ``base`` (the
  protocol), ``local``, ``s3``.
- ``transport/``: how bytes leave the daemon. HTTP (``http/``: the app and
  its middleware, the connection layer (the only module that touches
  aiohttp's internals) and the fast lane, request bodies, RFC 9110 ranges,
  forwarding between workers, the request's admission ticket, ``routes/``), the S3 gateway (``s3/``),
  NIXL (``nixl/``), the batch framing, the errors' statuses.
- ``buckets/``: the S3 gateway's lasting state: its SQLite catalog of
  buckets, objects and uploads, kept as record blocks of the tenants and
  rebuilt from them.
- ``qos/``: ``admission`` (the one object every transport asks: requests
  in flight, the tenants' shares, their limits, the fair gate, the counts)
  over ``policy``, ``buckets`` (node-wide token buckets), ``fair`` (the fair
  gate), ``shares`` and ``limits``;
  ``events/`` (residency events and their publishers), ``fleet/`` (nodes on
  one bucket: membership, placement, takeover, the registry's checks, the
  writer's state for reader workers, the fleet's metrics).
- ``daemon/``: the composition root: ``main`` (``kvstore serve``),
  ``supervisor`` (the workers), ``process`` (one process), ``listeners``,
  ``node`` (the store, the admission, events, NIXL and the fleet, opened
  and closed in one order; ``fleet``: a fleet node's parts) and ``app``
  (the HTTP transport over the node).
- At the top: what every part shares (``errors``, ``config``, ``metrics``,
  ``names``, ``redaction``, ``tasks``, ``buffers``), the daemon's settings
  and host (``cli``: the ``kvstore`` command, ``server_config``,
  ``settings_doc``, ``sdnotify``, ``tuning``, ``workers``) and the offline
  checker (``fsck``).
"""

# The build's identity, written by each build from git (clients/build_version.py):
# "X.Y.Z" for a tagged release, "X.Y.Z.devN+gHASH" otherwise. A source tree that
# was never built or installed (``pip install -e .`` writes it) says so.
try:
    from kvstore._version import __commit__ as _node
    from kvstore._version import __version__ as __version__
except ImportError:  # pragma: no cover - a tree never built
    __version__ = "0+unknown"
    _node = "unknown"
__commit__: str = (_node or "unknown").removeprefix("g")
"""The git commit the build was made from (abbreviated), or "unknown"."""
