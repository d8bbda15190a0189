"""The HTTP API (docs/API.md) on aiohttp, and what the S3 gateway's HTTP shares with it.

- ``app``: the application: its middlewares in order, health, routes, and
  start-up/shutdown in one ordered place (``cleanup_ctx``).
- ``middleware``: metering, error mapping (the one place errors become
  bodies), the gate (token, path parameters, ``Expect``), forwarding.
- ``appkeys`` (what the app and a request carry), ``auth`` (bearer tokens),
  ``query`` (typed query parameters), ``respond`` (error bodies, sending
  within a timeout).
- ``bodies``: request bodies (streamed blocks, bounded JSON, the
  buffered-body budget) and the JSON fields several routes read.
- ``ranges`` (RFC 9110 ranges and validators), ``sendfile`` (zero-copy answers).
- ``forward`` (a reader relaying writes to the writer) and ``internal`` (the
  writer's ``/_internal/`` routes for its readers).
- ``connection``: the connection layer (aiohttp's HTTP/1.1 protocol answering
  in kvstore's terms); ``unix``: listening unix sockets.
- ``metrics``: the ``/metrics`` route, merged over every worker.
- ``routes/``: the API's routes, one module per group (blocks, batch, admin,
  plans, records, xfer, events).
"""
