"""The connection layer: aiohttp's HTTP/1.1 protocol, answering in kvstore's terms.

aiohttp answers some requests without ever reaching the application: those
its parser rejects (a bad Content-Length or Transfer-Encoding, an invalid
method, a header line over the limit, a control character in a header), and
those whose handler raised past every middleware (a client that went away
mid-answer). Left alone it answers them in text/plain built from the parser's
message, which echoes the offending bytes (an ``Authorization`` header
included), and logs each at ERROR with that message and a traceback. It also
serves whatever HTTP version its parser accepts (``HTTP/2.0`` and HTTP/0.9
requests were answered as if they were HTTP/1.x), bounds a request whose
headers never end only by the keep-alive timeout, and answers ``Expect``
itself before any middleware runs (100 before authentication; a text/plain
417 echoing the header otherwise).

:class:`KVRequestHandler` answers them with the documented JSON error body
and a fixed message per kind of error (never the request's bytes), logs
parser rejections and disconnects at DEBUG without their text, and keeps a
half-closed connection open long enough to answer the request in progress
(a short body then gets ``400 invalid_input``, not a dropped connection).
It refuses HTTP versions other than 1.0 and 1.1 with ``505`` (RFC 9110
§15.6.6), and answers ``408`` to a request whose line and headers have not
all arrived ``request_timeout_s`` after its first byte, wherever in a read
that byte is (an idle keep-alive connection is still the keep-alive
timeout's). It works around aiohttp 3.14's parser losing a slot of its queue
to a request whose body spans reads (:meth:`KVRequestHandler._recount`).
:class:`KVAppRunner` is ``web.AppRunner`` serving connections with it; for
the kvstore API (``gate_expect``) it takes ``Expect`` away from aiohttp and
leaves it on the request (:data:`EXPECT`) for the gate, which answers it
after authentication (kvstore/transport/http/middleware.py).

This module is the one place that touches anything private of aiohttp
(the fast lane reaches the parser's queue only through
:class:`KVRequestHandler`'s methods). What it relies on is listed in
:data:`AIOHTTP_RELIED_ON`; tests/http/test_aiohttp_fence.py checks each
entry against the installed aiohttp and names the one that changed, and
pyproject.toml bounds aiohttp to the minor versions that test passed on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpRequestParser, HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine, HttpProcessingError, InvalidURLError, LineTooLong
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest
from multidict import CIMultiDict, CIMultiDictProxy

from kvstore.transport.http.appkeys import CONFIG, EXPECT, METRICS, RESOLVED, TENANT, Resolved
from kvstore.transport.http.fastlane import BulkQueue, FastLane
from kvstore.transport.http.internal import private_socket
from kvstore.transport.http.respond import reset_transport

log = logging.getLogger("kvstore.http")

# aiohttp's parser limits, set explicitly so that docs/API.md can state them.
# They differ so that an answer can tell which one was passed (414 or 431).
MAX_LINE_SIZE = 8192  # the request target (path and query)
MAX_FIELD_SIZE = 8190  # one header field, name and value
MAX_HEADERS = 128  # header fields per request
# A request body aiohttp buffers before it stops reading (its read_bufsize:
# high water twice this). Over a read of the transport (256 KiB) so that the
# parser never keeps a PUT's first bytes back (see can_bypass).
MAX_BODY_BUFFER = 1 << 20
PARSER_LIMITS: dict[str, int] = {
    "max_line_size": MAX_LINE_SIZE,
    "max_field_size": MAX_FIELD_SIZE,
    "max_headers": MAX_HEADERS,
}


# Everything of aiohttp's internals this module relies on: (where, name, what
# for). tests/http/test_aiohttp_fence.py checks every entry.
AIOHTTP_RELIED_ON: tuple[tuple[str, str, str], ...] = (
    ("RequestHandler", "_messages", "the queue of parsed requests (a deque of (message or _ErrInfo, payload))"),
    ("RequestHandler", "_waiter", "the future aiohttp's loop awaits while it waits for a request (None otherwise)"),
    ("RequestHandler", "_force_close", "the connection closes now"),
    ("RequestHandler", "_close", "the connection closes after the answer in progress"),
    ("RequestHandler", "_parser", "the connection's HttpRequestParser, restarted after a body read around it"),
    ("RequestHandler", "_msg_queue_resume_size", "the queue length below which a paused read resumes"),
    ("RequestHandler", "_max_msg_queue_size", "the queue's limit, also the parser's"),
    ("RequestHandler", "_resume_reading_if_drained", "resumes reading paused for the queue (as aiohttp's loop does)"),
    ("RequestHandler", "_handle_request", "answers one request: (request, start_time, handler) -> (response, reset)"),
    ("RequestHandler", "_next_keepalive_close_time", "when an idle connection closes (moved on after a lane answer)"),
    ("RequestHandler", "_keepalive_timeout", "the keep-alive timeout"),
    ("RequestHandler", "_loop", "the connection's event loop"),
    ("BaseProtocol", "_buffer_paused", "reading paused for the queue"),
    ("BaseProtocol", "_reading_paused", "reading paused for a body's buffer"),
    ("BaseProtocol", "_upgraded", "the connection switched protocols: bytes go to aiohttp's tail, not the parser"),
    ("BaseProtocol", "_drain_helper", "awaits the transport's buffer below its high water"),
    ("web_protocol", "_ErrInfo", "an error answered in the queue's order: _ErrInfo(status, exc, message)"),
    (
        "HttpRequestParser",
        "message_consumed",
        "frees a parser slot when a queued request is taken; never below zero, so that calling it once per "
        "slot of the queue resets the count (_recount)",
    ),
    (
        "HttpRequestParser",
        "counts a request when its body ends",
        "the bug _recount works around: a request taken off the queue before its body ended is counted "
        "after it was freed, and a read of pipelined requests then stalls one short of the limit, with no "
        "one to feed the parser again (bench/repro/aiohttp_pipelined_body_hang.py); fixed: _recount may go",
    ),
    (
        "HttpRequestParser",
        "__init__",
        "(protocol, loop, limit, max_line_size=, max_field_size=, max_headers=, "
        "payload_exception=, auto_decompress=, max_msg_queue_size=)",
    ),
    ("Server", "_kwargs", "the protocol's arguments, for building ours"),
    ("Server", "__call__", "the protocol factory (no public hook for the protocol class)"),
    ("AppRunner", "_make_server", "builds the runner's web.Server, whose class is swapped for KVServer"),
    ("LineTooLong", "args[1]", "the limit that was passed: max_line_size (414) or max_field_size (431)"),
)

VERSIONS = (HttpVersion10, HttpVersion11)
END_OF_HEAD = b"\r\n\r\n"  # the empty line that ends a request's line and headers
DEFAULT_HEADERS_TIMEOUT_S = 60.0  # for an app without a ServerConfig (request_timeout_s's default)


class UnsupportedVersion(HttpProcessingError):
    """A request in an HTTP version other than 1.0 and 1.1 (HTTP/0.9's bare
    request line, ``HTTP/2.0`` sent as text): answered 505."""

    code = 505
    message = "HTTP version not supported"


class HeadersTimeout(HttpProcessingError):
    """A request whose line and headers did not all arrive in time: answered 408."""

    code = 408

    def __init__(self, seconds: float) -> None:
        super().__init__(message=f"the request line and headers did not arrive within {seconds:g} s")


def parser_error(exc: BaseException | None) -> tuple[int, str, str]:
    """(status, code, message) for a request aiohttp's parser rejected, or
    the connection layer refused. The message is fixed text chosen by the
    kind of error: the parser's own message quotes the request's bytes and
    is never passed on."""
    if isinstance(exc, HeadersTimeout):
        return 408, "request_timeout", exc.message
    if isinstance(exc, UnsupportedVersion):
        return 505, "http_version_not_supported", "only HTTP/1.1 and HTTP/1.0 are served"
    if isinstance(exc, LineTooLong):
        if str(exc.args[1]) == str(MAX_LINE_SIZE):  # see the module doc: the limit says which
            return 414, "uri_too_long", f"the request target (path and query) is over {MAX_LINE_SIZE} bytes"
        return 431, "headers_too_large", f"a header field is over {MAX_FIELD_SIZE} bytes"
    # The parser's description: the lines before the quoted request bytes
    # (fixed text from llhttp or aiohttp), never the bytes themselves.
    head = exc.message.split("\n\n")[0].lower() if isinstance(exc, HttpProcessingError) else ""
    if isinstance(exc, BadStatusLine) and "invalid http version" in head:
        return 505, "http_version_not_supported", "only HTTP/1.1 and HTTP/1.0 are served"
    if isinstance(exc, BadHttpMethod):
        return 400, "bad_request", "the request line's method is not an HTTP token (TLS sent to a plain-HTTP port?)"
    if isinstance(exc, InvalidURLError):
        return 400, "bad_request", "the request target is not a valid origin-form path"
    if isinstance(exc, BadStatusLine):
        return 400, "bad_request", "malformed request line: expected 'METHOD /path HTTP/1.1' ended by CRLF"
    desc = head.partition(":")[0]
    if "too many headers" in desc:
        return 431, "headers_too_large", f"more than {MAX_HEADERS} header fields"
    if "content-length" in desc:
        return 400, "bad_request", "invalid Content-Length: expected one decimal length and no Transfer-Encoding"
    if "transfer-encoding" in desc:
        return 400, "bad_request", "invalid Transfer-Encoding: only chunked is accepted, as the last coding"
    if "chunk" in desc:
        return 400, "bad_request", "malformed chunked body framing"
    if "host" in desc:
        return 400, "bad_request", "the Host header is missing"
    if "header" in desc:
        return 400, "bad_request", "invalid header: a control character, whitespace around a name, or line folding"
    return 400, "bad_request", "malformed HTTP request"


def _json_error(status: int, code: str, message: str) -> web.Response:
    body = json.dumps({"error": {"code": code, "message": message}})
    resp = web.Response(status=status, text=body, content_type="application/json")
    resp.force_close()  # after a framing error nothing more on this connection can be trusted
    return resp


class KVRequestHandler(RequestHandler):
    """aiohttp's protocol with kvstore's answers to what bypasses the app."""

    # Slots, as aiohttp's own classes have: an attribute of aiohttp's that
    # this class sets and that aiohttp renamed fails here, loudly, instead of
    # becoming a new attribute that nothing reads.
    __slots__ = (
        "_at_eof",
        "_body_length",
        "_handed",
        "_headers_timeout_s",
        "_headers_timer",
        "_kv_app",
        "_lane",
        "_last_bytes",
        "_loop_started",
        "_receiving",
        "_uncounted",
        "relayed",
    )

    def __init__(
        self, *args: Any, kv_app: web.Application | None = None, bulk: BulkQueue | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._kv_app = kv_app
        # GET/HEAD of a block answered without the framework (fastlane.py).
        self._lane = FastLane(self, kv_app, bulk) if bulk is not None and kv_app is not None else None
        self._receiving: StreamReader | None = None  # the body of the latest request parsed
        self._body_length: int | None = None  # its Content-Length (None: chunked, or none)
        self._last_bytes = b""  # the last 3 bytes the parser took (an empty line may span two reads)
        # The body of a request taken off the queue before it ended, until the
        # queue is next empty (_recount).
        self._uncounted: StreamReader | None = None
        self.relayed = False  # a reader worker's connection (the private socket): it counts the requests
        self._at_eof = False  # the client half-closed: what it sent is answered, then the connection closes
        self._loop_started = False  # aiohttp's loop (start) has begun: before, the queue is the lane's to take
        self._headers_timer: asyncio.TimerHandle | None = None
        # The request the lane handed back, with what it resolved of it (its tenant, its block).
        self._handed: tuple[RawRequestMessage, str | None, Resolved | None] | None = None
        config = kv_app.get(CONFIG) if kv_app is not None else None
        # The time a request's line and headers have, from their first byte:
        # the time its body has (request_timeout_s).
        self._headers_timeout_s = float(config.request_timeout_s) if config is not None else DEFAULT_HEADERS_TIMEOUT_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.relayed = self._kv_app is not None and private_socket(self._kv_app, transport)

    def _count(self, name: str, **labels: str) -> None:
        metrics = self._kv_app.get(METRICS) if self._kv_app is not None else None
        if metrics is not None:
            metrics.inc(name, 1, **labels)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # Part of an answer is out: only a cut connection can signal the
            # failure (aiohttp's own contract; it catches this ConnectionError).
            raise ConnectionError("the response is already partly sent")
        if status in (400, 408, 505) and isinstance(exc, HttpProcessingError):
            status, code, text = parser_error(exc)
            log.debug("rejected a malformed request from %s: %s (%s)", request.remote, text, type(exc).__name__)
            self._count("kvstore_http_rejected_total", status=str(status))
            return _json_error(status, code, text)
        if isinstance(exc, ConnectionError) or self.transport is None or self.transport.is_closing():
            log.debug("%s %s: the client disconnected", request.method, request.rel_url.path)
            return _json_error(500, "internal", "the client disconnected")
        if status == 504:
            log.error("%s %s: the handler timed out", request.method, request.rel_url.path)
            self._count("kvstore_errors_total", code="timeout")
            return _json_error(504, "timeout", "the request timed out in the server")
        log.error("%s %s: unhandled exception", request.method, request.rel_url.path, exc_info=exc)
        self._count("kvstore_errors_total", code="internal")
        return _json_error(500, "internal", "internal error")

    def data_received(self, data: bytes) -> None:
        lane = self._lane
        if lane is not None and lane.receiving:
            data = lane.body_bytes(data)  # a PUT's body, around the parser (fastlane.py)
            if not data:
                return
        self._parse(data)
        if lane is not None and not lane.off:
            lane.offer()  # the requests at the head it answers; then aiohttp is woken for the rest
        else:
            self.wake()

    def _parse(self, data: bytes) -> None:
        """aiohttp's parser (llhttp) takes ``data``: the requests it completes
        join the queue, but aiohttp's loop is not woken for them yet (the
        fast lane may take those at the head first; then :meth:`wake`). A
        request in an HTTP version this server does not speak is answered
        505 in its turn instead of being served."""
        waiter, self._waiter = self._waiter, None
        before = len(self._messages)
        try:
            partial = self._feed(data)
        finally:
            self._waiter = waiter
        for i in range(before, len(self._messages)):
            message = self._messages[i][0]
            if not isinstance(message, _ErrInfo) and message.version not in VERSIONS:
                self._messages[i] = (_ErrInfo(status=505, exc=UnsupportedVersion(), message=""), EMPTY_PAYLOAD)
        self._time_headers(partial, len(self._messages) > before)

    def _feed(self, data: bytes) -> bool | None:
        """The parser takes ``data``, in pieces that show where its requests
        end; whether the bytes so far end inside a request's line and
        headers (True: they are timed), not (False), or that cannot be told
        (None: the parser may hold bytes back; or only empty lines came).

        A head ends with an empty line, so bytes that end with one end no
        head midway, and neither do the bytes of a body. Else, from a body's
        end (by its length) or from a head's, the next empty line ends the
        next head: one piece per request, for a read that ends inside one
        (or after a body), never a search through a body's bytes."""
        if not data or data.endswith(END_OF_HEAD):
            self._push(data)
            return False if data else None
        at, n, ended = 0, len(data), False
        while at < n:
            if self._may_hold():
                self._push(data[at:] if at else data)
                return None
            body = self._receiving
            if body is not None and not body.is_eof():  # the bytes of a body
                length = self._body_length
                left = None if length is None else length - body.total_bytes
                if left is None or left >= n - at:  # chunked (it ends with an empty line), or the rest is body
                    self._push(data[at:] if at else data)
                    return False if left is not None or self._in_body() else None
                self._push(data[at : at + left])
                at, ended = at + left, True
                continue
            # At the start of a request, or inside its line and headers.
            stop = data.find(END_OF_HEAD, at)
            stop = stop + len(END_OF_HEAD) if stop >= 0 else -1
            if stop < 0 and at == 0 and self._last_bytes:  # the empty line begun in the last read
                seam = (self._last_bytes + data[:3]).find(END_OF_HEAD)
                stop = seam + len(END_OF_HEAD) - len(self._last_bytes) if seam >= 0 else -1
            before = len(self._messages)
            if stop < 0:  # no head ends in the rest: inside one, or empty lines
                rest = data[at:] if at else data
                self._push(rest)
                if self._refused(before):
                    return None
                if rest.strip(b"\r\n"):
                    return True
                return False if ended else None
            self._push(data[at:stop])
            if self._refused(before):
                return None
            ended = ended or len(self._messages) > before
            at = stop
        return False if ended else None

    def _push(self, data: bytes) -> None:
        """aiohttp's ``data_received``: the parser takes ``data``, and the
        requests it completes join the queue."""
        before = len(self._messages)
        super().data_received(data)
        if len(self._messages) > before:
            message, payload = self._messages[-1]
            self._receiving = payload
            length = None if isinstance(message, _ErrInfo) else message.headers.get(hdrs.CONTENT_LENGTH)
            self._body_length = int(length) if length is not None else None  # (the parser checked it)
        if data:
            self._last_bytes = (self._last_bytes + data[-3:])[-3:]

    def _refused(self, before: int) -> bool:
        """Whether the parser refused what it took since the queue held
        ``before`` entries: the connection closes after that answer."""
        return len(self._messages) > before and isinstance(self._messages[-1][0], _ErrInfo)

    def _in_body(self) -> bool:
        body = self._receiving
        return body is not None and not body.is_eof()

    def _may_hold(self) -> bool:
        """Whether the parser may keep back bytes it is given (at its
        queue's limit, or one short of it: :meth:`_recount`; a body's buffer
        full), or parse none of them (closing, switched protocols)."""
        return (
            len(self._messages) >= self._max_msg_queue_size - 1
            or self._buffer_paused
            or self._reading_paused
            or self._upgraded
            or self._force_close
            or self._close
        )

    async def start(self) -> None:
        """aiohttp's loop over the queued requests. It begins a turn of the
        event loop after the connection is made, by which time the fast lane
        may have taken the first requests and hold one (a GET waiting in the
        bulk queue): then it first waits, as it would for a request, until
        :meth:`wake` (nothing is answered out of order)."""
        self._loop_started = True
        lane = self._lane
        if lane is not None and (lane.holding or not self._messages):
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        await super().start()

    def wake(self) -> None:
        """aiohttp's loop takes the queued requests, if it waits for one; at
        a half-close with nothing left to answer, the connection closes."""
        waiter = self._waiter
        if self._messages:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif self._at_eof and self.transport is not None and (not self._loop_started or (waiter and not waiter.done())):
            self.transport.close()  # idle, nothing left: (what is written still goes out first)

    # -- for the fast lane: the queue's head while aiohttp is idle ------------

    def next_message(self) -> tuple[RawRequestMessage, StreamReader] | None:
        """The request at the head of the queue, if aiohttp waits for one
        (idle, not closing) and it is a parsed request (not an error)."""
        waiter = self._waiter
        idle = not self._loop_started or (waiter is not None and not waiter.done())
        if not self._messages or not idle or self._force_close or self._close:
            return None
        message, payload = self._messages[0]
        if isinstance(message, _ErrInfo):
            return None
        return message, payload

    def take_message(self) -> None:
        """The fast lane takes the head of the queue: as aiohttp's loop
        does, a parser slot is freed and reading resumes once the queue
        has drained (aiohttp's bound on what a connection may queue)."""
        _, payload = self._messages.popleft()
        if self._parser is not None:
            self._parser.message_consumed()
        if not payload.is_eof():
            self._uncounted = payload
        if self._buffer_paused and len(self._messages) <= self._msg_queue_resume_size:
            self._resume_reading_if_drained()
        if not self._messages and self._uncounted is not None:
            self._recount()

    def _recount(self) -> None:
        """aiohttp 3.14's parser (llhttp) counts a request in its queue when
        the request ends, and aiohttp frees the request's slot when it takes
        it off the queue: a request taken before its body ended (one whose
        body spans reads) is counted after its slot was freed (freeing stops
        at zero), and holds a slot until the parser is replaced. The parser
        then stops one request short of the queue's limit, holding the rest
        of a read of pipelined requests back, with aiohttp's queue under the
        size at which it feeds the parser again: those requests waited for
        the client's next bytes, or the keep-alive timeout (48 answers to 60
        pipelined requests). Called once the queue is empty after such a
        request: nothing parsed waits then, so the count is set to zero
        (``message_consumed`` once per slot: it stops at zero), and what the
        parser holds back is parsed, as aiohttp does when its queue drains."""
        parser = self._parser
        if parser is None:
            return
        for _ in range(self._max_msg_queue_size):
            parser.message_consumed()
        if self._uncounted is not None and self._uncounted.is_eof():
            self._uncounted = None  # counted (or never will be): nothing more to undo
        if not self._buffer_paused and not self._reading_paused:
            self._parse(b"")

    def give_back(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        body: bytes,
        tenant: str | None = None,
        resolved: Resolved | None = None,
    ) -> None:
        """A request the fast lane took and does not answer after all: at the
        head of the queue again, for aiohttp (``body``: what the lane read
        of its payload, which the route reads again). ``tenant`` and
        ``resolved``: what the lane found of it, which its request carries
        to the route (:meth:`handed`), so nothing is looked up twice."""
        self._handed = (message, tenant, resolved) if tenant is not None else None
        if body:
            payload = StreamReader(self, MAX_BODY_BUFFER, loop=self._loop)
            payload.feed_data(body)
            payload.feed_eof()
        self._messages.appendleft((message, payload))

    def handed(self, message: RawRequestMessage) -> tuple[str | None, Resolved | None]:
        """What the lane resolved of ``message``, if it handed it back (else nothing)."""
        handed, self._handed = self._handed, None
        if handed is None or handed[0] is not message:
            return None, None
        return handed[1], handed[2]

    def can_bypass(self, payload: StreamReader) -> bool:
        """Whether the rest of ``payload``'s body (the request just taken)
        may be read around the parser, which then restarts at the next
        request: nothing was parsed after it, and the parser holds nothing
        unparsed (it keeps bytes back only once a body passes its high
        water, or the queue its limit)."""
        return (
            not self._messages
            and payload.total_bytes < MAX_BODY_BUFFER
            and not self._buffer_paused
            and not self._reading_paused
        )

    def restart_parser(self) -> None:
        """A new parser for the connection, at the start of a request: the
        body the fast lane read around the old one has ended (the old
        parser's body of it, and its count, go with it)."""
        self._receiving = self._uncounted = None
        self._body_length = None
        self._last_bytes = b""
        self._parser = HttpRequestParser(
            self,
            self._loop,
            MAX_BODY_BUFFER,
            max_line_size=self.max_line_size,
            max_field_size=self.max_field_size,
            max_headers=self.max_headers,
            payload_exception=RequestPayloadError,
            auto_decompress=False,
            max_msg_queue_size=self._max_msg_queue_size,
        )

    async def _handle_request(self, request: BaseRequest, start_time: float | None, request_handler: Any) -> Any:
        """aiohttp's; at a half-close, the connection closes after the last
        answer, and the fast lane takes nothing more once it is closing.
        A request with a body may have been taken before its body ended
        (:meth:`_recount`, once the queue is empty)."""
        lane = self._lane
        if request.body_exists:
            self._uncounted = request.content
        if not self._messages and self._uncounted is not None:
            self._recount()
        try:
            resp, reset = await super()._handle_request(request, start_time, request_handler)
        except BaseException:
            if lane is not None:
                lane.off = True
            raise
        if self._at_eof and not self._messages:
            self.close()  # the last request the client sent before its half-close is answered
        if lane is not None and (reset or not resp.keep_alive or self._force_close or self._close):
            lane.off = True
        await self._taken()
        return resp, reset

    async def _taken(self) -> None:
        """After an answer, the next request waits until the client takes
        what is buffered for it (the transport below its high water), for
        up to ``request_timeout_s``; then the connection is reset and
        counted as a disconnect. aiohttp writes an answer of less than 64
        KiB without waiting, so a client that pipelined requests and read
        no answer had them all answered into the daemon's memory (60,000
        answers, 180 MB, in 8 s here); now it gets about one answer past
        the transport's buffer, and aiohttp's queue of 32 requests stops
        reading it."""
        if not self.writing_paused or self.transport is None or self._force_close:
            return
        try:
            async with asyncio.timeout(self._headers_timeout_s):
                await self._drain_helper()
        except TimeoutError:
            log.debug("a client read nothing for %s s: connection reset", self._headers_timeout_s)
            self._count("kvstore_http_client_disconnects_total", route="connection")
            if self.transport is not None:
                reset_transport(self.transport)
        except ConnectionError:
            pass

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """aiohttp's, after the fast lane's PUT in progress (aiohttp sees no
        request in progress then, and would close the connection under it),
        and without waiting for a client that does not read."""
        if self._lane is not None:
            await self._lane.drain(timeout)
        if self.writing_paused and self.transport is not None:
            # A client that does not read its answers holds nothing up at a
            # stop: it is cut now (the old lane kept such a worker busy
            # for minutes after SIGTERM).
            reset_transport(self.transport)
        await super().shutdown(timeout)

    def body_started(self) -> None:
        """The fast lane receives a PUT's body (bounded by request_timeout_s
        itself) and then stores it: aiohttp, idle meanwhile, must not close
        the connection as idle. (The headers' timer, if it runs, is the next
        request's, begun in the read that ended the PUT's body.)"""
        self._next_keepalive_close_time = self._loop.time() + 86400.0

    def answered(self) -> None:
        """The fast lane answered a request: the keep-alive timer starts
        over, as after any answer. (The headers' timer, if it runs, is the
        next request's: it began arriving meanwhile.)"""
        self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout

    def _time_headers(self, partial: bool | None, got_request: bool) -> None:
        """Bound the time a request's line and headers may take to arrive,
        from their first byte: the timer runs while the bytes read end inside
        a request's line and headers (``partial``, :meth:`_feed`; None: as it
        was); a request parsed stops it, and the next request's starts anew."""
        timer = self._headers_timer
        if timer is not None and (got_request or partial is False):
            timer.cancel()
            self._headers_timer = timer = None
        if partial and timer is None:
            self._headers_timer = self._loop.call_later(self._headers_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        """The headers did not arrive in time: a 408 is queued as the next
        answer (after any request in progress), then the connection closes."""
        self._headers_timer = None
        if self._force_close or self._close or self.transport is None:
            return
        exc = HeadersTimeout(self._headers_timeout_s)
        self._messages.append((_ErrInfo(status=408, exc=exc, message=""), EMPTY_PAYLOAD))
        if self._lane is not None and self._lane.holding:
            return  # after the lane's answer in progress (it wakes aiohttp then)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None
        if self._lane is not None:
            self._lane.lost()
        super().connection_lost(exc)

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio.Protocol's contract: bool | None
        """The client half-closed its side (shutdown(SHUT_WR)). aiohttp would
        close the connection at once, dropping the answer to the request in
        progress, or answer that one and drop those pipelined after it.
        Instead every request the client sent is answered, in order, on
        either path (the fast lane's or aiohttp's), then the connection
        closes; a body being received ends here (a short body becomes ``400
        invalid_input``). An idle connection closes at once, as before."""
        if self._lane is not None and self._lane.flush():
            self._at_eof = True  # the lane answers what it holds first, then wake() closes
            return True
        return self._input_ended()

    def _input_ended(self) -> bool:
        """No more bytes will come: False if nothing is left to answer (the
        connection may close now), else True, and it closes after the last
        answer (:meth:`_handle_request`)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done() and not self._messages:
            return False  # idle: waiting for a request that cannot come now
        body = self._receiving
        if body is not None and not body.is_eof():
            body.feed_eof()
        self._at_eof = True
        if not self._messages:
            self.close()  # the request in progress is the last: aiohttp closes after its answer
        return True


class KVServer(web.Server):
    """``web.Server`` whose connections are :class:`KVRequestHandler`."""

    kv_app: web.Application | None = None
    fast_lane = False
    bulk: BulkQueue | None = None  # the fast lanes' GETs, in turns (one per server: its event loop)

    def __call__(self) -> RequestHandler:
        bulk = self.bulk if self.fast_lane else None
        return KVRequestHandler(self, loop=self._loop, kv_app=self.kv_app, bulk=bulk, **self._kwargs)


def _without_expect(message: RawRequestMessage) -> RawRequestMessage:
    """``message`` without its ``Expect`` header fields."""
    headers = CIMultiDict((k, v) for k, v in message.headers.items() if k.lower() != "expect")
    raw = tuple((k, v) for k, v in message.raw_headers if k.lower() != b"expect")
    return message._replace(headers=CIMultiDictProxy(headers), raw_headers=raw)


class KVAppRunner(web.AppRunner):
    """``web.AppRunner`` serving ``app`` with :class:`KVRequestHandler`
    connections, the parser limits of :data:`PARSER_LIMITS`, and bodies
    never decoded by aiohttp.

    ``gate_expect``: the request's ``Expect`` is taken from aiohttp, which
    would answer it before any middleware (a 100 before authentication, a
    text/plain 417 echoing the value), and left on the request as
    :data:`~kvstore.transport.http.appkeys.EXPECT` for the app to answer (the
    kvstore API: after its gate). False for an app that answers ``Expect``
    with aiohttp's own hook (the S3 gateway's ``expect_handler``)."""

    def __init__(self, app: web.Application, *, gate_expect: bool = True, **kwargs: Any) -> None:
        # auto_decompress off: a body is what the client sent, on every path.
        # The API refuses one in a content coding (415, middleware.py); the S3
        # gateway stores an object's bytes as sent, as S3 does.
        super().__init__(app, **{**PARSER_LIMITS, **kwargs, "read_bufsize": MAX_BODY_BUFFER, "auto_decompress": False})
        self._gate_expect = gate_expect

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # AppRunner builds a plain web.Server; make it build our protocol. The
        # class swap keeps every argument aiohttp gave it (see the module doc).
        server.__class__ = KVServer
        cast(KVServer, server).kv_app = self.app
        # The kvstore API (not the S3 gateway): its hot reads may take the fast lane.
        config = self.app.get(CONFIG)
        cast(KVServer, server).fast_lane = self._gate_expect and config is not None and config.fast_lane
        cast(KVServer, server).bulk = BulkQueue()
        if self._gate_expect:
            factory = server.request_factory

            def make_request(
                message: RawRequestMessage,
                payload: StreamReader,
                protocol: RequestHandler,
                writer: AbstractStreamWriter,
                task: asyncio.Task[None],
            ) -> BaseRequest:
                tenant, resolved = protocol.handed(message) if isinstance(protocol, KVRequestHandler) else (None, None)
                expect = message.headers.getall("Expect", None) if message.headers else None
                request = factory(
                    message if expect is None else _without_expect(message), payload, protocol, writer, task
                )
                if isinstance(request, web.Request):
                    if expect is not None:
                        request[EXPECT] = ",".join(expect)
                    if tenant is not None:  # the lane authenticated it: the gate does not again
                        request[TENANT] = tenant
                    if resolved is not None:  # and found its block (or not): the route goes on from there
                        request[RESOLVED] = resolved
                return request

            server.request_factory = make_request
        return server
