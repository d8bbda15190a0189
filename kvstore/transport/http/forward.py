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
(``gate_middleware`` in middleware.py runs on every worker), and relays the path as
it was received, still percent-encoded: a decoded ``%2F``, ``%3F``, ``%23`` or
``..`` never becomes path syntax on the writer.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from yarl import URL

from kvstore.errors import InvalidInput, KVStoreError, Overloaded, RequestTimeout, StoreClosed, WriterTimeout
from kvstore.transport.http.appkeys import (
    FOLLOWER,
    RELAY_UNKNOWN_TOKEN,
    STATE,
    client_gone,
    config_of,
    route_of,
    store_of,
)
from kvstore.transport.http.bodies import BAD_BODY_FRAMING, check_length
from kvstore.transport.http.query import query_number
from kvstore.transport.http.respond import send

WRITER = web.AppKey("writer", aiohttp.ClientSession)
# A request relayed to the writer is counted by the reader the client sent it
# to (kvstore_http_requests_total, the tenant's requests), not again by the
# writer; but a reader that did not know the token (RELAY_UNKNOWN_TOKEN) could
# not count its tenant, and says so with this header: the writer counts it.
UNCOUNTED = "Kvstore-Relay-Uncounted"
T = TypeVar("T")
# The writer's private socket refuses a connection at once (EAGAIN) while its
# accept queue is full (a burst of relays): the relay tries again for this
# long before it answers 503 overloaded. Nothing of the request is sent yet.
CONNECT_RETRY_S = 5.0
# A relay the writer may legitimately take any time to answer (a batch put's
# stream, compaction, a scrub) has no read timeout; it fails instead once the
# writer has not answered its health check (asked every PING_S) for as long
# as another relay may go without a byte of its answer (_margin).
PING_S = 5.0
# Admin calls whose work has no bound of its own: relayed without a read timeout (watched).
UNBOUNDED = frozenset({"/v1/batch/put", "/v1/admin/compact", "/v1/admin/verify"})
_SENT = (
    "Authorization",
    "Content-Type",
    "Content-Length",
    "If-None-Match",
    "Range",
    "Last-Event-ID",
    "Kvstore-Block-Meta",
    "Kvstore-Fleet-Version",  # a fleet client's writes (routes/fleet.refuse_misplaced)
)
_RETURNED = (
    "Content-Type",
    "ETag",
    "WWW-Authenticate",
    "Retry-After",
    "Content-Range",
    "Allow",
    "Cache-Control",
    "Kvstore-Registry-Revision",  # a fleet node's admin answers (routes/admin.py)
    "Kvstore-Owner",  # a fleet node's 421 misdirected (routes/fleet.py)
)
# Routes every worker answers itself; every other matched route goes to the writer.
LOCAL_ROUTES = frozenset(
    {
        ("GET", "/v1/blocks/{key}"),
        ("HEAD", "/v1/blocks/{key}"),
        ("GET", "/v1/records/{key}"),  # the key check looks at the client's own connection
        ("POST", "/v1/lookup"),
        ("POST", "/v1/batch/get"),
        ("POST", "/v1/read-plan"),  # descriptors come from the worker that holds the connection
        ("POST", "/v1/write-plan"),  # the writer reserves; this worker passes the descriptors
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

# Reads that may find a block of a dead node this fleet node took over: only
# the writer holds those stores, so while it holds any, readers relay these.
ADOPTED_READS = frozenset(
    {
        ("GET", "/v1/blocks/{key}"),
        ("HEAD", "/v1/blocks/{key}"),
        ("GET", "/v1/records/{key}"),
        ("POST", "/v1/lookup"),
        ("POST", "/v1/batch/get"),
        ("POST", "/v1/read-plan"),
    }
)


def relayed(request: web.Request) -> bool:
    """Whether the writer must answer ``request``: a matched route that is not
    one of the reads every worker serves, or on a fleet node one that may
    find a block the writer took over from a dead node while it serves any.
    Unmatched paths and methods are answered where they arrive (the same
    404/405 the writer would give)."""
    if request.match_info.http_exception is not None:
        return False
    if request.get(RELAY_UNKNOWN_TOKEN):  # a token this worker does not know: the writer checks the fleet's registry
        return True
    route = (request.method, route_of(request))
    return route not in LOCAL_ROUTES or (route in ADOPTED_READS and serving_takeovers(request.app))


def serving_takeovers(app: web.Application) -> bool:
    """On a fleet node's reader worker: whether its writer serves blocks of
    dead nodes now (kvstore/fleet/shared.py)."""
    follower = app.get(FOLLOWER)
    return follower is not None and follower.takeovers() > 0


def writer_url(request: web.Request) -> URL:
    """The writer's URL for ``request``: the path and query exactly as they
    arrived (percent-encoded), never re-normalized."""
    return URL("http://writer" + request.rel_url.raw_path_qs, encoded=True)


async def _relayed_body(
    request: web.Request, fault: list[KVStoreError], deadline: float | None
) -> AsyncIterator[bytes]:
    """The request's body as it arrives. A body cut short of its
    Content-Length (the client half-closed) or with broken chunked framing is
    noted in ``fault`` and the relay aborted, so the reader answers the 400
    the writer would have given, instead of the writer waiting for bytes that
    will never come. So is a body that does not arrive in time (408): whole
    by ``deadline`` (request_timeout_s from the relay's start, before the
    writer's own timer starts), or for a stream (``deadline`` None) within
    request_timeout_s of each read, as the writer bounds it. The reader used
    to wait for such a body without a bound: the writer's 408 never reached
    it (aiohttp's client reads no answer while it still sends the body), and
    it answered 503 "writer process unavailable", logged at ERROR, once the
    relay's connection closed (the keep-alive timeout, 75 s)."""
    expected = request.content_length
    seconds = config_of(request).request_timeout_s
    got = 0
    try:
        while True:
            try:
                async with asyncio.timeout(seconds) if deadline is None else asyncio.timeout_at(deadline):
                    chunk = await request.content.readany()
            except TimeoutError:
                fault.append(RequestTimeout(f"body not received within {seconds} s"))
                raise ConnectionAbortedError("the request body did not arrive in time") from None
            if not chunk:
                break
            got += len(chunk)
            yield chunk
    except RequestPayloadError:
        fault.append(InvalidInput(BAD_BODY_FRAMING))
        raise
    if expected is not None and got < expected:
        fault.append(InvalidInput(f"body ended after {got} of {expected} bytes (Content-Length)"))
        raise ConnectionAbortedError("the request body ended early")


def _read_timeout(request: web.Request) -> float | None:
    """Seconds the writer may go without sending a byte of its answer. It
    bounds a stalled body by itself (408 after request_timeout_s), so the
    reader waits longer than that and relays the writer's answer; a flush
    takes up to its ``timeout_s`` more. None for the routes of
    :data:`UNBOUNDED`, which are watched instead (:func:`watch_writer`)."""
    route = route_of(request)
    if route in UNBOUNDED:
        return None
    margin = _margin(request)
    if route == "/v1/admin/flush":
        try:
            return margin + query_number(request, "timeout_s", 0, 86_400, 600)
        except InvalidInput:
            return margin  # the writer answers the 400
    return margin


def _margin(request: web.Request) -> float:
    """How long the writer may go without a byte: it bounds a stalled
    body by itself after request_timeout_s, and answers then."""
    return config_of(request).request_timeout_s + 30.0


async def _watched(request: web.Request, call: Awaitable[T]) -> T:
    """``call``, unless the writer stops answering its health checks first
    (then 504: it may still complete the request)."""
    task = asyncio.ensure_future(call)
    loop = asyncio.get_running_loop()
    state, hung = request.app[STATE], _margin(request)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=min(PING_S, hung / 4))
            if done:
                return task.result()
            if loop.time() - state.get("writer_seen", loop.time()) > hung:
                raise WriterTimeout(
                    f"the writer process has not answered its health check for {hung:g} s while it had this"
                    " request; it may still complete it"
                )
    finally:
        if not task.done():
            task.cancel()


async def watch_writer(app: web.Application, path: str) -> None:
    """A reader's lifetime: note when the writer last answered ``/healthz``
    (over a connection of its own, so a busy relay pool cannot delay it)."""
    loop = asyncio.get_running_loop()
    app[STATE]["writer_seen"] = loop.time()
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path, limit=1)) as session:
        while True:
            try:
                async with session.get("http://writer/healthz", timeout=aiohttp.ClientTimeout(total=PING_S)) as r:
                    if r.status == 200:
                        app[STATE]["writer_seen"] = loop.time()
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass  # noted by writer_seen not moving
            await asyncio.sleep(PING_S)


def _busy(e: BaseException) -> bool:
    """Whether ``e`` is the writer's accept queue being full (EAGAIN on connect)."""
    return isinstance(e, aiohttp.ClientConnectorError) and e.os_error.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


async def _open(request: web.Request, headers: dict[str, str], fault: list[KVStoreError]) -> aiohttp.ClientResponse:
    """The writer's answer to ``request`` (its headers; the body follows)."""
    seconds = _read_timeout(request)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=seconds)
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CONNECT_RETRY_S
    # A body arrives whole within request_timeout_s, from now; a stream's each read (bodies.py).
    streamed = route_of(request) in UNBOUNDED
    deadline = None if streamed else loop.time() + config_of(request).request_timeout_s
    pause = 0.005
    while True:
        body = _relayed_body(request, fault, deadline) if request.body_exists else None
        call = request.app[WRITER].request(
            request.method, writer_url(request), headers=headers, data=body, timeout=timeout
        )
        try:
            return await (call if seconds is not None else _watched(request, call))
        except aiohttp.ClientConnectorError as e:
            if not _busy(e):
                raise
            if loop.time() + pause > give_up:
                raise Overloaded(
                    "the writer process is busy: its queue of relayed connections is full; retry"
                ) from None
            await asyncio.sleep(pause)  # nothing was sent: the body is untouched
            pause = min(pause * 2, 0.2)


async def forward(request: web.Request) -> web.StreamResponse:
    if request.method == "PUT" and route_of(request) == "/v1/blocks/{key}":
        # Refuse what the writer would refuse before streaming a body to it.
        check_length(request, store_of(request).config.max_block_size)
    headers = {h: request.headers[h] for h in _SENT if h in request.headers}
    if request.get(RELAY_UNKNOWN_TOKEN):
        headers[UNCOUNTED] = "tenant"
    fault: list[KVStoreError] = []
    try:
        upstream = await _open(request, headers, fault)
    except TimeoutError:  # aiohttp's ServerTimeoutError too: no byte for the read timeout
        if fault:
            raise fault[0] from None
        raise WriterTimeout(
            f"the writer process did not answer within {_read_timeout(request)} s; it may still complete the request"
        ) from None
    except (aiohttp.ClientError, ConnectionError) as e:
        if fault:
            raise fault[0] from None
        if client_gone(request):
            raise ConnectionResetError("the client disconnected") from None
        raise StoreClosed(f"the writer process is unavailable ({type(e).__name__}); retry") from None
    streams: set[aiohttp.ClientResponse] = request.app[STATE].setdefault("relayed_streams", set())
    async with upstream as r:
        resp = web.StreamResponse(status=r.status, headers={h: r.headers[h] for h in _RETURNED if h in r.headers})
        if r.content_length is not None:
            resp.content_length = r.content_length
        await resp.prepare(request)
        streams.add(r)
        try:
            while True:
                try:
                    chunk = await r.content.read(1 << 20)
                except (aiohttp.ClientError, ConnectionError):
                    if request.app[STATE].get("stopping"):
                        break  # end_relayed_streams: this worker stops
                    # The writer went away mid-answer: the headers are sent, so the
                    # only honest signal left is a cut connection.
                    if request.transport is not None:
                        request.transport.close()
                    raise
                if not chunk:
                    break
                await send(request, resp, chunk)
        finally:
            streams.discard(r)
        await resp.write_eof()
        return resp


async def end_relayed_streams(app: web.Application) -> None:
    """A reader's shutdown: the answers it is relaying end now. An event
    stream ends only when the writer stops, and readers stop before the
    writer: relayed streams held a reader's shutdown for shutdown_timeout_s."""
    app[STATE]["stopping"] = True
    for r in list(app[STATE].get("relayed_streams", ())):
        r.close()
