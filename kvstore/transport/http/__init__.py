"""The HTTP API (docs/API.md) on aiohttp, and what the S3 gateway's HTTP shares with it.

- ``app``: the application: its middlewares, health, and start-up/shutdown in
  one ordered place (``cleanup_ctx``).
- ``common``: app keys, authentication, error bodies, query parameters.
- ``bodies``: request bodies (streamed blocks, bounded JSON, the buffered-body budget).
- ``ranges`` (RFC 9110 ranges and validators), ``sendfile`` (zero-copy answers).
- ``forward`` (a reader relaying writes to the writer) and ``internal`` (the
  writer's ``/_internal/`` routes for its readers).
- ``connection``: the connection layer (aiohttp's HTTP/1.1 protocol answering
  in kvstore's terms); ``unix``: listening unix sockets.
- ``metrics``: the ``/metrics`` route, merged over every worker.
- ``routes/``: the API's routes, one module per group (blocks, batch, admin,
  plans, records, xfer, events).
"""
