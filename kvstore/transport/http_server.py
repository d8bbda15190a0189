"""The connection layer: aiohttp's HTTP/1.1 protocol, answering in kvstore's terms.

aiohttp answers some requests without ever reaching the application: those
its parser rejects (a bad Content-Length or Transfer-Encoding, an invalid
method, a header line over the limit, a control character in a header), and
those whose handler raised past every middleware (a client that went away
mid-answer). Left alone it answers them in text/plain built from the parser's
message, which echoes the offending bytes (an ``Authorization`` header
included), and logs each at ERROR with that message and a traceback.

:class:`KVRequestHandler` answers them with the documented JSON error body
and a fixed message per kind of error (never the request's bytes), logs
parser rejections and disconnects at DEBUG without their text, and keeps a
half-closed connection open long enough to answer the request in progress
(a short body then gets ``400 invalid_input``, not a dropped connection).
:class:`KVAppRunner` is ``web.AppRunner`` serving connections with it.

aiohttp hooks relied on (3.14; tests/http/test_hostile.py fails if they change):

- ``RequestHandler.handle_error(request, status, exc, message)`` builds the
  answer to a parser error (status 400, ``exc`` the parser's exception) and to
  an exception escaping the handler (500); it is public but undocumented.
- ``web.Server.__call__`` is the protocol factory, building a
  ``RequestHandler(server, loop=server._loop, **server._kwargs)``; the runner
  makes its server build ours instead. There is no public hook for the
  protocol class.
- ``RequestHandler._messages`` (requests parsed, not yet started) and
  ``._waiter`` (pending while the connection waits for a request), read by
  :meth:`KVRequestHandler.data_received` and :meth:`~KVRequestHandler.eof_received`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, BadStatusLine, HttpProcessingError, InvalidURLError, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvstore.transport.http_common import METRICS

log = logging.getLogger("kvstore.http")

# aiohttp's parser limits, set explicitly so that docs/API.md can state them.
MAX_LINE_SIZE = 8190  # the request line
MAX_FIELD_SIZE = 8190  # one header field, name and value
MAX_HEADERS = 128  # header fields per request
PARSER_LIMITS: dict[str, int] = {
    "max_line_size": MAX_LINE_SIZE,
    "max_field_size": MAX_FIELD_SIZE,
    "max_headers": MAX_HEADERS,
}


def parser_error(exc: BaseException | None) -> tuple[int, str, str]:
    """(status, code, message) for a request aiohttp's parser rejected. The
    message is fixed text chosen by the kind of error: the parser's own
    message quotes the request's bytes and is never passed on."""
    if isinstance(exc, LineTooLong):
        return 431, "headers_too_large", f"the request line or a header field is over {MAX_FIELD_SIZE} bytes"
    if isinstance(exc, BadHttpMethod):
        return 400, "bad_request", "the request line's method is not an HTTP token (TLS sent to a plain-HTTP port?)"
    if isinstance(exc, InvalidURLError):
        return 400, "bad_request", "the request target is not a valid origin-form path"
    if isinstance(exc, BadStatusLine):
        return 400, "bad_request", "malformed request line: expected 'METHOD /path HTTP/1.1' ended by CRLF"
    # Classify by the parser's description (its first line, fixed text from
    # llhttp or aiohttp), never by the quoted bytes that follow it.
    desc = exc.message.partition(":")[0].lower() if isinstance(exc, HttpProcessingError) else ""
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

    def __init__(self, *args: Any, kv_app: web.Application | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kv_app = kv_app
        self._receiving: StreamReader | None = None

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
        if status == 400 and isinstance(exc, HttpProcessingError):
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
        super().data_received(data)
        if self._messages:
            self._receiving = self._messages[-1][1]  # the body of the latest request parsed

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio.Protocol's contract: bool | None
        """The client half-closed its side (shutdown(SHUT_WR)). aiohttp would
        close the connection at once, dropping the answer to the request in
        progress. Instead the body being received ends here (a short body
        becomes ``400 invalid_input``), the answer is sent, then the
        connection closes. An idle connection closes at once, as before."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            return False  # idle: waiting for a request that cannot come now
        body = self._receiving
        if body is not None and not body.is_eof():
            body.feed_eof()
        self.close()  # nothing can follow a half-close: close after this answer
        return True


class KVServer(web.Server):
    """``web.Server`` whose connections are :class:`KVRequestHandler`."""

    kv_app: web.Application | None = None

    def __call__(self) -> RequestHandler:
        return KVRequestHandler(self, loop=self._loop, kv_app=self.kv_app, **self._kwargs)


class KVAppRunner(web.AppRunner):
    """``web.AppRunner`` serving ``app`` with :class:`KVRequestHandler`
    connections and the parser limits of :data:`PARSER_LIMITS`."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **{**PARSER_LIMITS, **kwargs})

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # AppRunner builds a plain web.Server; make it build our protocol. The
        # class swap keeps every argument aiohttp gave it (see the module doc).
        server.__class__ = KVServer
        cast(KVServer, server).kv_app = self.app
        return server
