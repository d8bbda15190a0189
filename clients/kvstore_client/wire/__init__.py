"""The formats the client and the daemon both speak, written once.

The daemon imports this package (``kvstore`` depends on the ``kvstore-client``
distribution); nothing here imports the rest of the client, and the client
stays installable alone.

- :mod:`.keys`: the key grammar;
- :mod:`.batchframe`: the batch framing of ``/v1/batch/put`` and ``/v1/batch/get``;
- :mod:`.envelope`: the record envelope of ``GET /v1/records/{key}`` (needs
  the decode extra, as the codecs);
- :mod:`.sealing`: how sealed frames are bound to their record, and the
  additional data of everything sealed;
- :mod:`.codec`: the frame codecs (raw, zstd, zstd over byte planes; needs
  ``kvstore-client[decode]``: zstandard, numpy);
- :mod:`.nixl_loader`: loading NIXL's Python API and making an agent;
- :mod:`.headers`: header fields of kvstore's own;
- :mod:`.errors`: what they raise. Each side turns these into its own errors
  (the daemon's carry its HTTP statuses, the client's its fail-open codes).
"""
