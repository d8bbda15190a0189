"""The S3 gateway's lasting state: buckets, their objects and multipart uploads.

- ``catalog``: the SQLite catalog (buckets, objects, uploads, parts), the
  gateway's index, a cache of its records as LMDB is of the segments.
- ``records``: the catalog kept as record blocks of the bucket's tenant, so
  it is mirrored, sealed and compacted with the tenant's blocks.
- ``recovery``: the catalog brought in line with the records at start-up
  (rebuilt from them on a new node).
- ``objects``: objects' bytes as blocks of the bucket's tenant.
- ``names``: S3's bucket-name rules.

It stands on the engine's public things (the store, kvstore.errors,
kvstore.names) and speaks no protocol: nothing here imports aiohttp or
anything under kvstore.transport. The gateway's HTTP
(kvstore/transport/s3/) maps its errors to S3's answers.
"""
