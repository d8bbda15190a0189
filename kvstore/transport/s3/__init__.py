"""The S3-compatible gateway's HTTP: a second listener speaking S3's REST API
over the tenants' blocks (docs/API.md, "S3 gateway").

- ``gateway``: the application and its routes; ``call`` (one request),
  ``sigv4`` (signature checks), ``acl``, ``errors`` and ``xml`` (S3's error
  and listing documents), ``body`` (checksummed request bodies).
- ``bucket_ops``, ``object_ops``, ``multipart_ops``: the operations by noun.

A regular package (this file): a folder without one is left out of the wheel.
"""
