"""The fast lane: GET, HEAD and PUT of a block, and lookups, answered without
the framework's request and response objects.

A ranged GET of 256 KiB cost the daemon about 0.5 ms of CPU through aiohttp
(nginx: 0.08), most of it the framework's request and response objects, the
middleware stack and the handler's awaits; the bytes themselves go with
sendfile. The lane answers the requests it can answer completely on the
spot, on the event loop. It frames nothing itself: every byte of a
connection goes through aiohttp's parser (llhttp), whose limits and
refusals apply to every request, and the lane takes the parsed requests at
the head of the connection's queue while aiohttp waits for one
(connection.py, which owns every use of aiohttp's internals). It takes:

- ``GET`` or ``HEAD /v1/blocks/{key}`` over HTTP/1.1 kept alive, no query,
  no body, no ``Expect``, one ``Host``, the fields it reads present once and
  in visible ASCII (:func:`hot_request`);
- a tenant token the store knows, a key that passes the route's check, a
  block present in a direct tenant's segment already open in this process,
  its covering frames verified (verified.py: once per open file) within the
  inline budget; ``If-None-Match`` and ``Range`` as the route does;
- the answer's status line and headers built in one buffer and written,
  then the bytes with sendfile (what the socket does not take at once goes
  through the transport, in order, and must be taken within
  ``request_timeout_s``, as the route's answers must);
- ``POST /v1/lookup`` without ``lease_s`` whose JSON arrived whole;
- ``PUT /v1/blocks/{key}`` on the worker that writes, with a
  ``Content-Length`` of 1 to ``max_block_size``, a known token and a valid
  ``Kvstore-Block-Meta`` (if any), within the tenant's shares of the worker
  (shares.py). What the parser has of the body is copied into pooled
  page-aligned memory; the rest is read around the parser by a buffered
  protocol (:class:`_BodyReader`): the kernel reads it straight into that
  memory, never past its end, and the segment write takes it from there
  with ``O_DIRECT``; then the connection's protocol and a new parser take
  the next request. Errors after the body (the store's, ``408`` for a body
  that stalls, ``400`` for one a half-close cut short) are the route's
  answers, written here.

Every other request, and any the lane cannot finish (401, 404, 416, a
block not yet verified, a limit to wait for), is aiohttp's: the parsed
request is put back at the head of the queue and aiohttp answers it and
what follows it. Order on a connection is kept: the lane answers only at
the head while aiohttp is idle, a GET waiting in the bulk queue holds what
follows it, and a client that stops reading (the transport paused for
writing) gets aiohttp's pace from then on. The parser's queue (32
requests) bounds what a client that does not read can make the daemon
hold.

The lane keeps every guarantee of the route: authentication, tenant
isolation (the index is keyed by the token's tenant), checksums before any
byte leaves, leases (a read holds its segment until the bytes are handed
to the kernel or the transport), ``/metrics`` (the same request, byte and
lookup counters), and the route's status codes and headers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Protocol, cast

from aiohttp.http import SERVER_SOFTWARE, HttpVersion11, RawRequestMessage
from aiohttp.streams import StreamReader

from kvstore.buffers import POOL, AlignedBuffer
from kvstore.engine.api import DirectExtent
from kvstore.errors import InvalidInput, KVStoreError, NotAdmitted, NotFound, Overloaded, RequestTimeout, Unauthorized
from kvstore.events.model import BlockMeta
from kvstore.names import validate_client_key, validate_key
from kvstore.qos.admission import Ticket
from kvstore.transport.http.appkeys import CONFIG, METRICS, STORE, Resolved
from kvstore.transport.http.auth import bearer
from kvstore.transport.http.bodies import keys_field, parse_json, tokens_per_block_field
from kvstore.transport.http.forward import UNCOUNTED, WRITER, serving_takeovers
from kvstore.transport.http.middleware import error_answered
from kvstore.transport.http.qos import ADMISSION
from kvstore.transport.http.ranges import etag_matches, parse_range, range_spec_count
from kvstore.transport.http.respond import SEND_PIECE, error_body, reset_transport
from kvstore.transport.http.routes.fleet import misplaced, with_adopted
from kvstore.transport.http.sendfile import sendfile_extent
from kvstore.transport.statuses import http_status

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("kvstore.http")
MAX_LOOKUP_BODY = 64 << 10  # a lookup's JSON (max_lookup_keys keys); bigger ones are the route's
BULK_SLICE_S = 0.0005  # bulk answers made per turn of the event loop, at most about this long
_JSON = b"application/json"
_JSON_TYPES = frozenset({_JSON, b"application/json; charset=utf-8", b"application/json;charset=utf-8"})
ROUTE = "/v1/blocks/{key}"
LOOKUP = "/v1/lookup"
ROUTE_PREFIX = "/v1/blocks/"
# The fields the lane reads: present twice, or with a byte that is not
# visible ASCII, the request is the route's.
_READ = frozenset(
    {
        b"host",
        b"expect",
        b"content-encoding",
        b"connection",
        b"content-length",
        b"content-type",
        b"authorization",
        b"range",
        b"if-none-match",
        b"kvstore-block-meta",
    }
)
_UNCOUNTED = UNCOUNTED.lower().encode()  # a relay whose tenant the reader did not count: the route counts it
_JSON_ANSWER = "Content-Type: application/json; charset=utf-8\r\n"
_PUTS: set[asyncio.Task[None]] = set()  # the lane's puts in progress (held: the loop keeps weak references)
_OCTETS = "Content-Type: application/octet-stream\r\n"
_NOT_PLAIN_RE = re.compile(rb"[^\t\x20-\x7e]")  # a byte outside HTAB and visible ASCII + SP
_NOT_A_KEY_RE = re.compile(r"[%?#/]")  # a path the route decodes or splits first: the route's


class _Date:
    """The Date header's value, formatted once a second."""

    second = -1
    value = ""

    @classmethod
    def now(cls) -> str:
        t = int(time.time())
        if t != cls.second:
            cls.second, cls.value = t, formatdate(t, usegmt=True)
        return cls.value


class Connection(Protocol):
    """What the lane needs of its connection (connection.py's
    KVRequestHandler, which owns every use of aiohttp's internals)."""

    transport: asyncio.Transport | None
    # Its requests are a reader worker's relays (the workers' private socket):
    # that worker counts them (middleware.relayed_to_me).
    relayed: bool

    @property
    def writing_paused(self) -> bool: ...

    def next_message(self) -> tuple[RawRequestMessage, StreamReader] | None: ...

    def take_message(self) -> None: ...

    def give_back(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        body: bytes,
        tenant: str | None = None,
        resolved: Resolved | None = None,
    ) -> None: ...

    def wake(self) -> None: ...

    def restart_parser(self) -> None: ...

    def can_bypass(self, payload: StreamReader) -> bool: ...

    def body_started(self) -> None: ...

    def answered(self) -> None: ...

    def force_close(self) -> None: ...

    def eof_received(self) -> bool: ...

    def connection_lost(self, exc: BaseException | None) -> None: ...

    def pause_writing(self) -> None: ...

    def resume_writing(self) -> None: ...


class FastLane:
    """The requests of one connection that the lane answers itself."""

    __slots__ = (
        "_app",
        "_bulk",
        "_offering",
        "_proto",
        "_pushed",
        "_queued",
        "_sending",
        "_stall",
        "_upload",
        "off",
    )

    def __init__(self, proto: Connection, app: web.Application, bulk: BulkQueue) -> None:
        self._proto = proto
        self._app = app
        self._bulk = bulk
        self._queued = False  # a GET of this connection waits in the bulk queue
        self._upload: _Upload | None = None  # a PUT the lane receives or stores
        self._offering = False  # offer() is running (aiohttp may re-enter through the parser)
        self._stall: asyncio.TimerHandle | None = None  # the check that the client takes its answers (_taken)
        self._sending = 0  # bytes in the transport's buffer at the last check
        self._pushed = 0  # bytes the lane wrote to the transport since then
        self.off = False  # the connection closes, or shuts down: the lane takes nothing more

    @property
    def connection(self) -> Connection:
        return self._proto

    def body_bytes(self, data: bytes) -> bytes:
        """Bytes the transport read for the connection while a PUT's body is
        being received: the body's (the transport may have read some before
        the body reader took over), and what follows it, returned."""
        up = self._upload
        if up is None or not up.left or not data:
            return data
        n = up.take(data)
        if not up.left:
            self._store(up)
        return bytes(memoryview(data)[n:]) if n < len(data) else b""

    @property
    def receiving(self) -> bool:
        """A PUT's body is being received (the parser does not see it)."""
        return self._upload is not None and self._upload.left > 0

    def offer(self) -> None:
        """Take the requests aiohttp's parser put at the head of the
        connection's queue that the lane answers, while aiohttp is idle:
        control calls (HEAD, 304s, lookups) answered at once, a GET queued
        for the bulk queue, a PUT received; then aiohttp is woken for what
        is left (in order: the lane stops at the first request it does not
        answer). The parser's limits apply to every request, and its queue
        bounds what a client that does not read its answers can send."""
        if self._offering:
            return
        self._offering = True
        proto = self._proto
        try:
            while not self.off and not self.holding and not proto.writing_paused:
                head = proto.next_message()
                if head is None:
                    break
                message, payload = head
                req = hot_request(message, payload)
                if req is None:
                    break
                proto.take_message()
                if req.method == "GET" and (req.if_none_match is None or req.range is not None):
                    self._queued = True
                    self._bulk.add(self, req)
                elif req.method == "PUT":
                    if not self._receive(req):
                        proto.give_back(message, payload, b"", req.tenant)
                        break
                elif not self._answer(req):
                    proto.give_back(message, payload, req.body, req.tenant, req.resolved)
                    break
        finally:
            self._offering = False
        if not self.holding:
            proto.wake()

    def answer_queued(self, req: _Hot) -> None:
        """The bulk queue's turn for this connection's GET."""
        self._queued = False
        if self.off:
            return  # the connection closed meanwhile
        if not self._answer(req):  # aiohttp's to answer, and what follows it
            self._proto.give_back(req.message, req.payload, b"", req.tenant, req.resolved)
            self._proto.wake()
            return
        self.offer()

    def flush(self) -> bool:
        """The client sent its last bytes. True when the lane answers first
        what it holds (a PUT: one whose body ended short is answered 400 and
        the connection closed now; the GET in the bulk queue); aiohttp then
        answers the rest, and the connection closes (connection.py)."""
        up = self._upload
        if up is not None and up.left:
            self._end_upload(up, reuse=True)
            self._answer_error(InvalidInput(f"body ended after {up.pos} of {up.length} bytes (Content-Length)"), up)
            self._proto.force_close()
            return True
        return self.holding

    def lost(self) -> None:
        """The connection is gone: a body being received is dropped (a PUT
        being stored goes on; its answer has nowhere to go)."""
        self.off = True
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        up = self._upload
        if up is not None and up.left:
            self._end_upload(up, reuse=True)

    async def drain(self, timeout: float | None) -> None:
        """The server shuts down: take nothing more, and wait (up to
        ``timeout``) for the PUT in progress to be received, stored and answered."""
        self.off = True
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._upload is not None and (deadline is None or loop.time() < deadline):
            await asyncio.sleep(0.01)

    @property
    def holding(self) -> bool:
        """A request of this connection is in the lane's hands (a GET in the
        bulk queue, a PUT received or stored): what follows waits for it."""
        return self._queued or self._upload is not None

    def _answer(self, req: _Hot) -> bool:
        """Answer ``req`` here; False (nothing sent, nothing counted) to leave it to aiohttp."""
        app = self._app
        admission = app[ADMISSION]
        if not admission.ready:
            return False
        transport = self._proto.transport  # (uvloop's are not asyncio.Transport subclasses: never isinstance)
        if transport is None or transport.is_closing() or not req.token:
            return False
        t0 = time.perf_counter()
        store = app[STORE]
        if req.method == "POST":
            return self._answer_lookup(req, transport, t0)
        try:
            tenant = req.tenant = store.authenticate(req.token)
            if tenant is None:
                return False  # 401: the route's answer
            info = store.resolve(tenant, req.key)  # (counted: the route goes on from here)
        except NotFound as e:
            req.resolved = Resolved(req.key, missing=e)
            return False  # the route's 404 (or a block a fleet node took over)
        except KVStoreError:
            return False
        req.resolved = Resolved(req.key, info)
        size = info.size
        etag = f'"{info.etag}"'
        head = f"ETag: {etag}\r\nAccept-Ranges: bytes\r\n"
        if req.if_none_match is not None and etag_matches(req.if_none_match, etag):
            ticket = admission.try_enter(tenant, counted=not self._proto.relayed)
            if ticket is None:
                return False  # a limit to wait for: the route's (kvstore/qos/admission.py)
            self._write(
                transport,
                _close_head(f"HTTP/1.1 304 Not Modified\r\n{head}{_OCTETS if req.method == 'HEAD' else ''}"),
            )
            self._finish(req.method, "304", t0, ticket)
            return True
        if req.method == "HEAD":
            ticket = admission.try_enter(tenant, counted=not self._proto.relayed)
            if ticket is None:
                return False
            self._write(transport, _close_head(f"HTTP/1.1 200 OK\r\n{head}{_OCTETS}Content-Length: {size}\r\n"))
            self._finish("HEAD", "200", t0, ticket)
            return True
        status, start, end = "200 OK", 0, size
        if req.range is not None:
            try:
                ranges = parse_range(req.range, size)
            except KVStoreError:
                return False  # 416: the route's answer
            if ranges is not None and range_spec_count(req.range) == 1:
                r = ranges[0]
                status, start, end = "206 Partial Content", r.start, r.end
                head += f"Content-Range: {r.content_range(size)}\r\n"
        # A direct block's extent of its segment (sendfile), or a sealed one's
        # plaintext from the decoded-blocks cache; else the route completes the read.
        now = store.sendable_now(tenant, info, start, end)
        extent = now if isinstance(now, DirectExtent) else None
        body = now.view if isinstance(now, DirectExtent) else now
        ticket = admission.try_enter(tenant, counted=not self._proto.relayed) if body is not None else None
        if ticket is not None and not self._admit_read(ticket, end - start):
            ticket.refuse()
            ticket = None
        if body is None or ticket is None:
            if extent is not None:
                extent.release()
            return False
        metrics = app[METRICS]
        count = len(body)
        try:
            self._write(transport, _close_head(f"HTTP/1.1 {status}\r\n{head}{_OCTETS}Content-Length: {count}\r\n"))
            sent = 0
            if extent is not None and app[CONFIG].sendfile:
                try:
                    sent = sendfile_extent(transport, extent, metrics)
                except ConnectionResetError:
                    transport.abort()
                    metrics.inc("kvstore_http_client_disconnects_total", route=ROUTE)
                    ticket.close()
                    return True
            if sent < count:
                self._write(
                    transport, body[sent:]
                )  # a read-only view (the mapping, or the cached plaintext), kept alive
        finally:
            if extent is not None:
                extent.release()
            ticket.hold_until_sent(transport)  # its transfer slot: until the transport has sent what it holds
        ticket.moved("out", count)
        self._finish("GET", status[:3], t0, ticket)
        return True

    def _answer_lookup(self, req: _Hot, transport: asyncio.Transport, t0: float) -> bool:
        """``POST /v1/lookup`` without ``lease_s``: the route's checks and answer."""
        app, store, admission = self._app, self._app[STORE], self._app[ADMISSION]
        if serving_takeovers(app):
            return False  # a reader worker while its writer holds dead nodes' blocks: the writer's (forward.py)
        try:
            tenant = req.tenant = store.authenticate(req.token) if req.token else None
            if tenant is None:
                return False
            if not req.body:
                req.body = req.payload.read_nowait(-1)  # (whole: hot_request saw its end; given back if need be)
            body = parse_json(req.body)
            if "lease_s" in body:
                return False  # locks: the route's (and the writer's)
            keys = keys_field(body, app[CONFIG].max_lookup_keys, validate=False)
            r = store.lookup_now(tenant, keys, tokens_per_block_field(body))
        except KVStoreError:
            return False  # the route's 400s, with its messages
        ticket = admission.try_enter(tenant, counted=not self._proto.relayed) if r is not None else None
        if r is None or ticket is None:
            return False
        present = with_adopted(app, tenant, list(keys), r.present)  # a dead node's blocks this node took over
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        doc = json.dumps({"prefix": prefix, "present": present}).encode()
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: {len(doc)}\r\n"
        self._write(transport, _close_head(head) + doc)
        self._finish("POST", "200", t0, ticket, LOOKUP)
        return True

    def _receive(self, req: _Hot) -> bool:
        """Take ``PUT /v1/blocks/{key}``: its body is received into pooled
        aligned memory as it arrives (no framework, no join), then stored.
        False (nothing taken, nothing counted) to leave it to the route:
        on a reader worker (writes are the writer's), another fleet node's
        key, an unknown token, a
        bad length or Kvstore-Block-Meta, the body budget or the requests
        in flight at their limits; those answers are the route's."""
        app = self._app
        admission, config = app[ADMISSION], app[CONFIG]
        transport = self._proto.transport
        if not admission.ready or WRITER in app or transport is None or transport.is_closing() or not req.token:
            return False
        if misplaced(app, req.key):
            return False  # another fleet node's key: the route's 421
        t0 = time.perf_counter()
        store = app[STORE]
        if not 0 < req.length <= store.config.max_block_size:
            return False
        if not req.payload.is_eof() and not self._proto.can_bypass(req.payload):
            return False  # the parser holds part of its body back: the route reads it
        try:
            tenant = req.tenant = store.authenticate(req.token)
            meta = BlockMeta.from_header(req.meta) if req.meta is not None else None
        except KVStoreError:
            return False
        # Its admission as the route's (kvstore/qos/admission.py), without a
        # wait: a request in flight, its write bytes, its body's memory.
        ticket = admission.try_enter(tenant, counted=not self._proto.relayed) if tenant is not None else None
        if ticket is None:
            return False
        if not ticket.try_reserve("write", req.length):
            ticket.refuse()
            return False
        try:
            ticket.hold_body(req.length)
        except Overloaded:
            ticket.give_back("write", req.length)
            ticket.refuse()
            return False
        up = self._upload = _Upload(ticket, req.key, meta, req.length, t0)
        up.take(req.payload.read_nowait(-1))  # what the parser had of the body
        self._proto.body_started()
        if up.left:
            up.timer = asyncio.get_running_loop().call_later(config.request_timeout_s, self._body_late)
            # The rest of the body is read by the kernel straight into the
            # aligned memory (a buffered protocol: no bytes objects, no copy),
            # never past its end; then the connection is aiohttp's protocol's
            # again, with a parser that starts at the next request.
            up.bypassed = True
            up.reader = _BodyReader(self, up)
            transport.set_protocol(up.reader)
        else:
            self._store(up)
        return True

    def body_in(self, up: _Upload) -> None:
        """The body reader filled the body."""
        self._restore(up)
        self._store(up)

    def _restore(self, up: _Upload) -> None:
        """The connection's protocol back from ``up``'s body reader."""
        reader, up.reader = up.reader, None
        transport = self._proto.transport
        if reader is not None and transport is not None and transport.get_protocol() is reader:
            transport.set_protocol(cast(asyncio.BaseProtocol, self._proto))

    def _store(self, up: _Upload) -> None:
        """The whole body is in: store it (a task: the put awaits its group commit)."""
        if up.bypassed:  # the parser saw the body's start only: the next byte begins a request
            up.bypassed = False
            self._proto.restart_parser()
        self._restore(up)
        if up.timer is not None:
            up.timer.cancel()
            up.timer = None
        up.ticket.moved("in", up.length)
        task = asyncio.get_running_loop().create_task(self._put(up))
        _PUTS.add(task)
        task.add_done_callback(_PUTS.discard)

    async def _put(self, up: _Upload) -> None:
        """Store ``up``'s block and answer as the route does."""
        app = self._app
        reuse = False
        try:
            async with up.ticket.transfer():  # (the body is in: a slot of the fair gate for its store)
                stored = await app[STORE].put(up.tenant, up.key, up.buf.view, up.meta)
        except NotAdmitted as e:  # its tenant's admit_after: nothing stored, no ETag (routes/blocks.py)
            reuse = True  # declined before the block was encoded: nothing refers to the memory
            status, head, doc = http_status(e), "", json.dumps(e.answer()).encode()
        except KVStoreError as e:
            status, head, doc = self._error_answer(e)
        except Exception:  # the route's answer to the unexpected: a 500, logged
            log.exception("PUT %s failed", ROUTE)
            app[METRICS].inc("kvstore_errors_total", code="internal")
            status, head, doc = 500, "", json.dumps(error_body("internal", "internal error")).encode()
        else:
            reuse = True  # the put ended normally: nothing still refers to the memory
            doc = json.dumps({"key": up.key, "size": stored.info.size, "created": stored.created}).encode()
            status, head = 201 if stored.created else 200, f'ETag: "{stored.info.etag}"\r\n'
        finally:
            self._end_upload(up, reuse)  # (cancelled, the loop closing: nothing more is answered)
        self._respond(status, head, doc, up)
        if not self.off:
            self.offer()  # what followed it (and at a half-close, the connection closes once all is answered)

    def _body_late(self) -> None:
        """The body did not arrive within request_timeout_s: 408, and the
        connection closes (the rest of the body cannot be told from the next request)."""
        up = self._upload
        if up is None or not up.left:
            return
        up.timer = None
        self._end_upload(up, reuse=True)
        self._answer_error(RequestTimeout(f"body not received within {self._app[CONFIG].request_timeout_s} s"), up)
        self.off = True
        self._proto.force_close()

    def _end_upload(self, up: _Upload, reuse: bool) -> None:
        """The budget and the in-flight slot back; the memory back to the
        pool only when nothing may still refer to it (``reuse``)."""
        if self._upload is not up:
            return
        self._upload = None
        self._restore(up)
        if up.timer is not None:
            up.timer.cancel()
            up.timer = None
        up.ticket.release_body(up.length)
        up.ticket.close()
        if reuse:
            up.buf.release()

    @staticmethod
    def _admit_read(ticket: Ticket, n: int) -> bool:
        """``n`` bytes of the tenant's reads and a slot of the fair gate, if
        neither needs a wait (else nothing of them is taken)."""
        if not ticket.try_reserve("read", n):
            return False
        if not ticket.try_transfer():
            ticket.give_back("read", n)
            return False
        return True

    def _answer_error(self, e: KVStoreError, up: _Upload) -> None:
        self._respond(*self._error_answer(e), up)

    def _error_answer(self, e: KVStoreError) -> tuple[int, str, bytes]:
        """A PUT's error answer as the route gives it: status, header lines, JSON body."""
        headers = error_answered(self._app, "PUT", ROUTE, e)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return http_status(e), extra, json.dumps(error_body(e.code, str(e))).encode()

    def _respond(self, status: int, head: str, doc: bytes, up: _Upload) -> None:
        """A PUT's JSON answer, written if the connection is still there, and counted."""
        transport = self._proto.transport
        if transport is not None and not transport.is_closing():
            reason = HTTPStatus(status).phrase
            line = f"HTTP/1.1 {status} {reason}\r\n{head}{_JSON_ANSWER}Content-Length: {len(doc)}\r\n"
            self._write(transport, _close_head(line) + doc)
        self._finish("PUT", str(status), up.t0, up.ticket)

    def _write(self, transport: asyncio.Transport, data: bytes | memoryview) -> None:
        """Every answer's bytes go out here: what the socket does not take at
        once waits in the transport's buffer, and the client must take it in
        time (:meth:`_taken`)."""
        transport.write(data)
        self._pushed += len(data)
        if self._stall is None and transport.get_write_buffer_size():
            self._sending, self._pushed = transport.get_write_buffer_size(), 0
            self._stall = asyncio.get_running_loop().call_later(self._app[CONFIG].request_timeout_s, self._taken)

    def _taken(self) -> None:
        """``request_timeout_s`` after the lane left bytes in the transport's
        buffer: the client must have taken SEND_PIECE of them (or all, if
        fewer) meanwhile, as the route requires of each piece it sends
        (respond.send); if not, the connection is reset and counted as a
        disconnect. A client that stopped reading used to keep its answer,
        the block's mapping and its transfer slot for as long as it kept the
        connection open. (Taken bytes are counted from the buffer's size and
        the lane's own writes since; answers aiohttp wrote meanwhile count as
        not taken, so they can only make the check stricter by their size.)"""
        self._stall = None
        transport = self._proto.transport
        if transport is None or transport.is_closing():
            return
        left = transport.get_write_buffer_size()
        if not left:
            return
        if self._sending + self._pushed - left >= min(SEND_PIECE, self._sending):
            self._sending, self._pushed = left, 0
            self._stall = asyncio.get_running_loop().call_later(self._app[CONFIG].request_timeout_s, self._taken)
            return
        log.debug(
            "a fast-lane answer: the client read nothing for %s s: connection reset",
            self._app[CONFIG].request_timeout_s,
        )
        reset_transport(transport)
        self._app[METRICS].inc("kvstore_http_client_disconnects_total", route=ROUTE)

    def _finish(self, method: str, status: str, t0: float, ticket: Ticket, route: str = ROUTE) -> None:
        """An answer is out: counted as the route counts it, what the request
        held given back, and the connection's timers told."""
        ticket.answered()
        ticket.close()
        metrics = self._app[METRICS]
        if not self._proto.relayed:  # (a relay: counted by the reader worker the client sent it to)
            metrics.inc("kvstore_http_requests_total", route=route, method=method, status=status)
            metrics.observe("kvstore_http_request_seconds", time.perf_counter() - t0, route=route, method=method)
        metrics.inc("kvstore_http_fast_lane_total", method=method)
        self._proto.answered()


class BulkQueue:
    """The GETs the fast lanes of one worker answer, in arrival order, for
    about BULK_SLICE_S per turn of the event loop. Between turns the loop
    reads its sockets, and control calls (lookups, HEAD, 304s) are answered
    as they are read: a lookup waits behind at most one slice of bulk
    transfers, not behind every GET that arrived before it."""

    def __init__(self) -> None:
        self._waiting: deque[tuple[FastLane, _Hot]] = deque()
        self._scheduled = False

    def add(self, lane: FastLane, req: _Hot) -> None:
        self._waiting.append((lane, req))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self._scheduled = False
        deadline = time.perf_counter() + BULK_SLICE_S
        while self._waiting:
            lane, req = self._waiting.popleft()
            try:
                lane.answer_queued(req)
            except Exception:
                log.exception("a fast-lane answer failed")
                lane.off = True
            if time.perf_counter() > deadline:
                break
        if self._waiting and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)


def _close_head(head: str) -> bytes:
    return f"{head}Date: {_Date.now()}\r\nServer: {SERVER_SOFTWARE}\r\n\r\n".encode("latin-1")


class _BodyReader(asyncio.BufferedProtocol):
    """The connection's protocol while a PUT's body arrives: the transport
    reads into the body's memory (at most what is left of it), and tells
    the connection's own protocol of everything else (aiohttp's handler)."""

    __slots__ = ("lane", "up")

    def __init__(self, lane: FastLane, up: _Upload) -> None:
        self.lane, self.up = lane, up

    def get_buffer(self, sizehint: int) -> memoryview:
        up = self.up
        return up.buf.memory[up.pos : up.length]

    def buffer_updated(self, nbytes: int) -> None:
        up = self.up
        up.pos += nbytes
        if up.pos >= up.length:
            self.lane.body_in(up)

    def eof_received(self) -> bool | None:
        return self.lane.connection.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lane.connection.connection_lost(exc)

    def pause_writing(self) -> None:
        self.lane.connection.pause_writing()

    def resume_writing(self) -> None:
        self.lane.connection.resume_writing()


class _Upload:
    """A PUT's body, received into pooled page-aligned memory as it arrives."""

    __slots__ = ("buf", "bypassed", "key", "length", "meta", "pos", "reader", "t0", "tenant", "ticket", "timer")

    def __init__(self, ticket: Ticket, key: str, meta: BlockMeta | None, length: int, t0: float) -> None:
        assert ticket.tenant is not None
        self.ticket, self.tenant, self.key, self.meta, self.length, self.t0 = (
            ticket,
            ticket.tenant,
            key,
            meta,
            length,
            t0,
        )
        self.buf: AlignedBuffer = POOL.take(length)
        self.pos = 0
        self.timer: asyncio.TimerHandle | None = None
        self.reader: _BodyReader | None = None
        self.bypassed = False  # the body goes around the parser (the body reader)

    @property
    def left(self) -> int:
        return self.length - self.pos

    def take(self, data: bytes) -> int:
        """Copy what of ``data`` belongs to the body; how many bytes that was."""
        n = min(self.length - self.pos, len(data))
        if n:
            self.buf.memory[self.pos : self.pos + n] = memoryview(data)[:n]
            self.pos += n
        return n


class _Hot:
    """A request the lane may answer: GET or HEAD of ``key``, a lookup (POST,
    its ``body``), or a PUT of ``key`` (``length`` bytes of body, ``meta``);
    with the parser's ``message`` and ``payload``, handed back to aiohttp
    should the lane not answer it after all."""

    __slots__ = (
        "body",
        "if_none_match",
        "key",
        "length",
        "message",
        "meta",
        "method",
        "payload",
        "range",
        "resolved",
        "tenant",
        "token",
    )

    def __init__(self, method: str, key: str, message: RawRequestMessage, payload: StreamReader) -> None:
        self.method = method
        self.key = key
        self.message = message
        self.payload = payload
        self.token = ""
        self.tenant: str | None = None  # what its token names, once authenticated: the route's too
        self.resolved: Resolved | None = None  # what the lane found of its block: where the route goes on
        self.range: str | None = None
        self.if_none_match: str | None = None
        self.body = b""
        self.length = 0
        self.meta: str | None = None


def hot_request(message: RawRequestMessage, payload: StreamReader) -> _Hot | None:
    """The request as the lane answers it, or None for the route's.

    ``message`` is what aiohttp's parser (llhttp) made of the request's
    bytes: its framing, limits and refusals are the parser's alone. The
    lane takes only plain requests: HTTP/1.1 kept alive, no upgrade, no
    chunked or encoded body, no ``Expect``, one ``Host``, and the fields it
    reads present once and in visible ASCII; anything else is the route's,
    which gives it the documented meaning."""
    if message.version != HttpVersion11 or message.should_close or message.upgrade or message.chunked:
        return None
    fields: dict[bytes, bytes] = {}
    for name, value in message.raw_headers:
        low = name.lower()
        if low in _READ and (low in fields or _NOT_PLAIN_RE.search(value) is not None):
            return None  # a repeated field, a control or non-ASCII byte: the route decides what it means
        fields[low] = value
    if (
        b"host" not in fields
        or b"expect" in fields
        or b"content-encoding" in fields
        or _UNCOUNTED in fields
        or fields.get(b"connection", b"keep-alive").lower() != b"keep-alive"
    ):
        return None
    length = fields.get(b"content-length")
    body = int(length) if length is not None else 0  # (the parser checked it: one decimal number)
    method, target = message.method, message.path
    if method == "POST" and target == LOOKUP:
        if not 0 < body <= MAX_LOOKUP_BODY or fields.get(b"content-type", _JSON).lower() not in _JSON_TYPES:
            return None
        if not payload.is_eof():
            return None  # its body is still coming: the route reads it
        hot = _Hot("POST", "", message, payload)
        hot.token = _bearer(fields)
        return hot
    put = method == "PUT"
    if (bool(body) != put) or method not in ("GET", "HEAD", "PUT") or not target.startswith(ROUTE_PREFIX):
        return None
    key = target[len(ROUTE_PREFIX) :]
    if not key or _NOT_A_KEY_RE.search(key) is not None or key in (".", ".."):
        return None
    try:
        (validate_client_key if put else validate_key)(key)
    except KVStoreError:
        return None
    hot = _Hot(method, key, message, payload)
    hot.token = _bearer(fields)
    if put:
        hot.length = body
        meta = fields.get(b"kvstore-block-meta")
        hot.meta = None if meta is None else meta.decode("latin-1")
        return hot
    rng = fields.get(b"range")
    hot.range = None if rng is None else rng.decode("latin-1")
    inm = fields.get(b"if-none-match")
    hot.if_none_match = None if inm is None else inm.decode("latin-1")
    return hot


def _bearer(fields: dict[bytes, bytes]) -> str:
    """The bearer token of the Authorization field ("" when there is none)."""
    auth = fields.get(b"authorization")
    if auth is None:
        return ""
    try:
        return bearer(auth.decode("latin-1"))  # the routes' reading of it
    except Unauthorized:
        return ""
