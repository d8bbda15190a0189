"""Reader workers relay writes to the writer worker over a unix socket.

With several worker processes, one (the writer) owns the store's writes:
segment appends, index commits, the registry. The others open the store for
reads and serve GET, HEAD, lookup, batch get and stats themselves; every other
route is relayed, body streamed, to the writer, which answers it as if it had
come in directly.

A route must mean the same on every worker. So the reader decides what to
relay by the route its own router matched (never by a prefix of the decoded
path), answers unmatched paths itself exactly as the writer would (404/405),
relays only after the same authentication and path checks the writer makes
(``gate_middleware`` in http.py runs on every worker), and relays the path as
it was received, still percent-encoded: a decoded ``%2F``, ``%3F``, ``%23`` or
``..`` never becomes path syntax on the writer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from yarl import URL

from kvstore.errors import InvalidInput, KVStoreError, StoreClosed
from kvstore.transport.http_body import BAD_BODY_FRAMING, check_length
from kvstore.transport.http_common import client_gone, config_of, route_of, send, store_of

WRITER = web.AppKey("writer", aiohttp.ClientSession)
_SENT = (
    "Authorization",
    "Content-Type",
    "Content-Length",
    "If-None-Match",
    "Range",
    "Last-Event-ID",
    "Kvstore-Block-Meta",
)
_RETURNED = ("Content-Type", "ETag", "WWW-Authenticate", "Retry-After", "Content-Range", "Allow", "Cache-Control")
# Routes every worker answers itself; every other matched route goes to the writer.
LOCAL_ROUTES = frozenset(
    {
        ("GET", "/v1/blocks/{key}"),
        ("HEAD", "/v1/blocks/{key}"),
        ("GET", "/v1/records/{key}"),  # the key check looks at the client's own connection
        ("POST", "/v1/lookup"),
        ("POST", "/v1/batch/get"),
        ("POST", "/v1/read-plan"),  # descriptors come from the worker that holds the connection
        ("DELETE", "/v1/read-plan/{lease}"),
        ("GET", "/v1/stats"),
        ("GET", "/healthz"),
        ("HEAD", "/healthz"),
        ("GET", "/readyz"),
        ("HEAD", "/readyz"),
        ("GET", "/metrics"),
        ("HEAD", "/metrics"),
    }
)


def relayed(request: web.Request) -> bool:
    """Whether the writer must answer ``request``: a matched route that is not
    one of the reads every worker serves. Unmatched paths and methods are
    answered where they arrive (the same 404/405 the writer would give)."""
    if request.match_info.http_exception is not None:
        return False
    return (request.method, route_of(request)) not in LOCAL_ROUTES


def writer_url(request: web.Request) -> URL:
    """The writer's URL for ``request``: the path and query exactly as they
    arrived (percent-encoded), never re-normalized."""
    return URL("http://writer" + request.rel_url.raw_path_qs, encoded=True)


async def _relayed_body(request: web.Request, fault: list[KVStoreError]) -> AsyncIterator[bytes]:
    """The request's body as it arrives. A body cut short of its
    Content-Length (the client half-closed) or with broken chunked framing is
    noted in ``fault`` and the relay aborted, so the reader answers the 400
    the writer would have given, instead of the writer waiting for bytes that
    will never come."""
    expected = request.content_length
    got = 0
    try:
        async for chunk in request.content.iter_any():
            got += len(chunk)
            yield chunk
    except RequestPayloadError:
        fault.append(InvalidInput(BAD_BODY_FRAMING))
        raise
    if expected is not None and got < expected:
        fault.append(InvalidInput(f"body ended after {got} of {expected} bytes (Content-Length)"))
        raise ConnectionAbortedError("the request body ended early")


def _relay_timeout(request: web.Request) -> aiohttp.ClientTimeout:
    """How long the writer may take to answer. It bounds a stalled body by
    itself (408 after request_timeout_s), so the reader waits longer than that
    and relays the writer's answer. Admin calls (flush, verify) and batch puts
    legitimately take as long as their work: no read timeout there; a writer
    that dies closes the socket."""
    route = route_of(request)
    if route.startswith("/v1/admin/") or route == "/v1/batch/put":
        return aiohttp.ClientTimeout(total=None, sock_read=None)
    return aiohttp.ClientTimeout(total=None, sock_read=config_of(request).request_timeout_s + 30)


async def forward(request: web.Request) -> web.StreamResponse:
    if request.method == "PUT" and route_of(request) == "/v1/blocks/{key}":
        # Refuse what the writer would refuse before streaming a body to it.
        check_length(request, store_of(request).config.max_block_size)
    headers = {h: request.headers[h] for h in _SENT if h in request.headers}
    fault: list[KVStoreError] = []
    body = _relayed_body(request, fault) if request.body_exists else None
    try:
        upstream = await request.app[WRITER].request(
            request.method, writer_url(request), headers=headers, data=body, timeout=_relay_timeout(request)
        )
    except (aiohttp.ClientError, ConnectionError) as e:
        if fault:
            raise fault[0] from None
        if client_gone(request):
            raise ConnectionResetError("the client disconnected") from None
        raise StoreClosed(f"the writer process is unavailable ({type(e).__name__}); retry") from None
    async with upstream as r:
        resp = web.StreamResponse(status=r.status, headers={h: r.headers[h] for h in _RETURNED if h in r.headers})
        if r.content_length is not None:
            resp.content_length = r.content_length
        await resp.prepare(request)
        while True:
            try:
                chunk = await r.content.read(1 << 20)
            except (aiohttp.ClientError, ConnectionError):
                # The writer went away mid-answer: the headers are sent, so the
                # only honest signal left is a cut connection.
                if request.transport is not None:
                    request.transport.close()
                raise
            if not chunk:
                break
            await send(request, resp, chunk)
        await resp.write_eof()
        return resp
