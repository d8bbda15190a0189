"""Read plans: a client on this host reads direct blocks itself, from the
segment files, with descriptors the daemon passes over the unix socket.

``POST /v1/read-plan`` ``{"keys": [...], "lease_s"?: number}`` answers, for
each key, the file that holds its bytes (an id on this connection), the
offset, the size, the frame size and each frame's xxh3-64; a block the
client cannot read itself (sealed, in the object tier only, missing) gets
the status and error a GET would give, and the client GETs it. The
descriptors of files this connection has not been given yet travel with the
answer's body as SCM_RIGHTS (at most 253 per message, on consecutive body
bytes; ``Kvstore-Fds`` says how many), in the order of ``files``. The
segments stay in place (neither compacted nor dropped) under a lease until
``DELETE /v1/read-plan/{lease}``, its expiry, or the connection's end; a
descriptor keeps a segment's bytes readable even after that (an unlinked
file lives on while a descriptor is open), so a plan never reads other bytes.
So that the space of such files comes back, each answer lists in ``closed``
the ids of files given before whose segments are gone; the client closes
those descriptors once no plan of its own still uses them.
"""

from __future__ import annotations

import array
import asyncio
import json
import logging
import os
import socket
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvstore.engine.lifecycle import Leases
from kvstore.engine.store_read import PlannedBlock
from kvstore.errors import InvalidInput, KVStoreError, NotFound, UnixSocketRequired
from kvstore.tasks import Background
from kvstore.transport.http_blocks import keys_field
from kvstore.transport.http_body import json_body
from kvstore.transport.http_common import STATE, STORE, config_of, reset_connection, send, store_of, tenant_of
from kvstore.transport.http_forward import WRITER
from kvstore.transport.http_internal import share_lease
from kvstore.transport.http_records import record_meta

log = logging.getLogger("kvstore.transport.plans")
routes = web.RouteTableDef()
LEASE_S = 30.0  # default lease of a plan
MAX_LEASE_S = 600.0
SCM_MAX_FD = 253  # descriptors one sendmsg may carry (Linux)
SWEEP_S = 1.0  # how soon leases of a closed connection are released


@dataclass
class _Connection:
    transport: weakref.ref[asyncio.Transport]
    files: dict[tuple[str, int, int], int] = field(default_factory=dict)  # segment -> id on this connection
    leases: set[str] = field(default_factory=set)
    next_id: int = 0
    epoch: int = -1  # the lifecycle epoch its files were last checked at

    def closed(self) -> bool:
        t = self.transport()
        return t is None or t.is_closing()


class PlanState:
    """Per connection: the files it was given and the leases it holds."""

    def __init__(self, leases: Leases, released: Callable[[], list[str]] | None = None) -> None:
        self._leases = leases
        self._conns: dict[int, _Connection] = {}
        # A reader worker: where released leases go, for the writer to release too.
        self._released = released

    def connection(self, transport: asyncio.Transport) -> _Connection:
        c = self._conns.get(id(transport))
        if c is None or c.transport() is not transport:
            c = self._conns[id(transport)] = _Connection(weakref.ref(transport))
        return c

    def release(self, transport: asyncio.Transport, lease_id: str) -> bool:
        """Release a lease this connection holds (False: it holds no such lease)."""
        c = self._conns.get(id(transport))
        if c is None or c.transport() is not transport or lease_id not in c.leases:
            return False
        c.leases.discard(lease_id)
        self._tell_writer([lease_id])
        return self._leases.release(lease_id)

    def _tell_writer(self, ids: list[str]) -> None:
        if self._released is not None and ids:
            self._released().extend(ids)

    def sweep(self) -> int:
        """Release the leases of connections that ended; returns how many."""
        n = 0
        for key in [k for k, c in self._conns.items() if c.closed()]:
            ids = list(self._conns.pop(key).leases)
            self._tell_writer(ids)
            for lid in ids:
                n += self._leases.release(lid)
        return n


PLANS = web.AppKey("plans", PlanState)


async def plans_ctx(app: web.Application) -> AsyncIterator[None]:
    """After the store opens: the plan state and its sweeper."""
    state = app[STATE]
    reader = state["role"] == "reader"
    app[PLANS] = PlanState(app[STORE].leases, (lambda: state["released_leases"]) if reader else None)
    bg = Background()

    async def sweeper() -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            app[PLANS].sweep()

    bg.spawn(sweeper(), "read-plan-sweeper")
    yield
    await bg.close()


def _unix_transport(request: web.Request) -> asyncio.Transport:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if transport is None or sock is None or sock.family != socket.AF_UNIX:
        raise UnixSocketRequired(
            "read plans pass file descriptors, so they are served on the daemon's unix socket only "
            "(listen = unix:PATH); use GET /v1/blocks/{key} here"
        )
    return transport


def _lease_s(body: dict[str, Any]) -> float:
    value = body.get("lease_s", LEASE_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LEASE_S:
        raise InvalidInput(f"field 'lease_s' must be a number of seconds in (0, {MAX_LEASE_S:g}]; got {value!r}")
    return float(value)


@routes.post("/v1/read-plan")
async def read_plan(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    transport = _unix_transport(request)
    body = await json_body(request)
    unknown = set(body) - {"keys", "lease_s"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    keys = keys_field(body, config_of(request).max_batch_keys, validate=False)
    lease_s = _lease_s(body)
    store = store_of(request)
    planned = await store.plan_reads(tenant, keys)
    try:
        conn = request.app[PLANS].connection(transport)
        # Files given before whose segments are gone (compacted, dropped,
        # deleted): the client closes its descriptors, so their space returns.
        # (Checked again only when a segment changed state somewhere.)
        closed: list[int] = []
        epoch = store.lifecycle_epoch()
        if epoch != conn.epoch:
            closed = [conn.files.pop(f) for f in [f for f in conn.files if not store.segment_alive(*f)]]
            conn.epoch = epoch
        files: list[int] = []
        fds: list[int] = []
        blocks: list[dict[str, Any]] = []
        segments = set()
        for key, p in zip(keys, planned, strict=True):
            if isinstance(p, KVStoreError):
                blocks.append({"key": key, "status": p.status, "error": {"code": p.code, "message": str(p)}})
                continue
            fid = conn.files.get(p.file)
            if fid is None:
                fid = conn.files[p.file] = conn.next_id
                conn.next_id += 1
                files.append(fid)
                fds.append(p.segment.fd)
            segments.add((p.file[0], p.file[2]))
            blocks.append(_block(tenant, p, fid))
        lease = store.leases.acquire(segments, lease_s)
        conn.leases.add(lease.id)
        if WRITER in request.app:  # a reader: the writer, which compacts and evicts, holds it too
            await share_lease(request.app, lease, lease_s)
        doc = {"lease": lease.id, "expires_in_s": lease_s, "files": files, "closed": closed, "blocks": blocks}
        payload = json.dumps(doc, separators=(",", ":")).encode()
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Kvstore-Fds": str(len(fds))})
        resp.content_length = len(payload)
        await resp.prepare(request)
        await _send_with_fds(request, resp, transport, payload, fds)
        await resp.write_eof()
        return resp
    finally:
        for p in planned:
            if isinstance(p, PlannedBlock):
                p.segment.release()


def _block(tenant: str, p: PlannedBlock, fid: int) -> dict[str, Any]:
    doc = {
        "key": p.key,
        "status": 200,
        "file": fid,
        "offset": p.offset,
        "size": p.size,
        "frame_size": p.frame_size,
        "xxh3": [f"{c:016x}" for c in p.checksums],
    }
    if p.record is not None:  # sealed: the stored frames start at offset; the client opens them
        doc["record"] = record_meta(tenant, p.key, p.size, 0, p.size, p.record)
    return doc


async def _send_with_fds(
    request: web.Request,
    resp: web.StreamResponse,
    transport: asyncio.Transport,
    payload: bytes,
    fds: list[int],
) -> None:
    """Send ``payload``; its first bytes carry ``fds`` (SCM_MAX_FD a byte)."""
    deadline = time.monotonic() + config_of(request).request_timeout_s
    sent = 0
    for i in range(0, len(fds), SCM_MAX_FD):
        chunk = array.array("i", fds[i : i + SCM_MAX_FD])
        while True:
            # The headers (and earlier pieces) go first, in order; the socket
            # is looked up right before it is used, with no await in between.
            if transport.is_closing():
                raise ConnectionResetError("the client went before its read plan was sent")
            if not transport.get_write_buffer_size():
                try:
                    n = _sendmsg(transport, payload[sent : sent + 1], chunk)
                    break
                except BlockingIOError:
                    pass
                except OSError as e:
                    reset_connection(request)
                    raise ConnectionResetError(f"the client went during its read plan: {e.strerror}") from None
            if time.monotonic() > deadline:
                reset_connection(request)
                raise ConnectionResetError("the client read nothing of its read plan")
            await asyncio.sleep(0.001)
        sent += n
    await send(request, resp, payload[sent:])


def _sendmsg(transport: asyncio.Transport, data: bytes, fds: array.array[int]) -> int:
    """One sendmsg on the transport's socket (a duplicate of its descriptor,
    closed at once: the transport keeps its own)."""
    fd = int(transport.get_extra_info("socket").fileno())
    with socket.socket(fileno=os.dup(fd)) as sock:
        return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])


@routes.delete("/v1/read-plan/{lease}")
async def release_plan(request: web.Request) -> web.Response:
    tenant_of(request)
    transport = _unix_transport(request)
    if not request.app[PLANS].release(transport, request.match_info["lease"]):
        raise NotFound("no such lease on this connection (released, expired, or never given)")
    return web.Response(status=204)
