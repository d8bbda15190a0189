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
Each descriptor is a read-only description of its own (opened again for the
client), so nothing the client does with it reaches the daemon's own.
So that the space of such files comes back, each answer lists in ``closed``
the ids of files given before whose segments are gone; the client closes
those descriptors once no plan of its own still uses them.

With ``plan_paths`` on, ``{"paths": true}`` asks for the segment files'
absolute paths instead (``"path"`` in each block, no descriptors, ``files``
and ``closed`` empty), over any listener: for clients on other hosts that
mount the data directory at the same path (NFS, Lustre, WEKA, VAST). A
sealed block's ``record`` (its own key) goes only where
``client_decode_allowed`` (TLS, unix, loopback); elsewhere that block is
``403 insecure_transport``. Such a lease belongs to the tenant, not to the
connection: any connection of the tenant releases it, else it expires. A
path read after the lease ended may find the file gone (a compacted segment's
file is removed, and its records live on in a newer segment, a new file
name) and fails (ENOENT); the frame checksums catch anything else, so a
path read never returns other bytes than the block's.
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

import aiohttp
from aiohttp import web

from kvstore.engine.api import Leases, PlannedBlock
from kvstore.errors import (
    InsecureTransport,
    InvalidInput,
    KVStoreError,
    LeaseNotFound,
    NotFound,
    NotPlannable,
    PathsNotOffered,
    StoreClosed,
    TenantNotFound,
    UnixSocketRequired,
)
from kvstore.tasks import Background
from kvstore.transport.http.appkeys import STATE, STORE, config_of, store_of
from kvstore.transport.http.auth import tenant_of
from kvstore.transport.http.bodies import json_body, keys_field, lease_field
from kvstore.transport.http.forward import WRITER, writer_url
from kvstore.transport.http.internal import share_lease
from kvstore.transport.http.qos import ticket_of
from kvstore.transport.http.respond import reset_connection, send
from kvstore.transport.http.routes.fleet import adopted_store
from kvstore.transport.http.routes.records import client_decode_allowed, record_meta
from kvstore.transport.statuses import http_status

log = logging.getLogger("kvstore.transport.plans")
routes = web.RouteTableDef()
SCM_MAX_FD = 253  # descriptors one sendmsg may carry (Linux)
SWEEP_S = 1.0  # how soon leases of a closed connection are released


@dataclass
class _Connection:
    transport: weakref.ref[asyncio.Transport]
    files: dict[tuple[str, int, int], int] = field(default_factory=dict)  # segment -> id on this connection
    leases: set[str] = field(default_factory=set)
    write_plans: set[str] = field(default_factory=set)  # ended with the connection (write_plans.py)
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
        self.ended_write_plans: list[str] = []
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
        """Release the leases of connections that ended, and forget expired
        ones (path plans' leases, held by no connection, end so); returns
        how many of the former. The write plans of those connections are
        left in :attr:`ended_write_plans` for the sweeper to end."""
        n = 0
        for key in [k for k, c in self._conns.items() if c.closed()]:
            conn = self._conns.pop(key)
            self.ended_write_plans.extend(conn.write_plans)
            ids = list(conn.leases)
            self._tell_writer(ids)
            for lid in ids:
                n += self._leases.release(lid)
        self._leases.forget_expired()
        return n

    def release_owned_lease(self, tenant: str, lease_id: str) -> bool:
        """Release a lease ``tenant`` owns (a path plan's, a lookup's lock)
        held in this process (False: none such here); a reader tells the writer too."""
        if not self._leases.release_owned(lease_id, tenant):
            return False
        self._tell_writer([lease_id])
        return True


PLANS = web.AppKey("plans", PlanState)


async def plans_ctx(app: web.Application) -> AsyncIterator[None]:
    """After the store opens: the plan state and its sweeper."""
    state = app[STATE]
    reader = state["role"] == "reader"
    app[PLANS] = PlanState(app[STORE].leases, (lambda: state["released_leases"]) if reader else None)
    bg = Background()

    async def sweeper() -> None:
        plans = app[PLANS]
        while True:
            await asyncio.sleep(SWEEP_S)
            plans.sweep()
            ended, plans.ended_write_plans = plans.ended_write_plans, []
            if ended and not reader:  # a reader worker's relayed plans end by their lease, on the writer
                await app[STORE].end_write_plans(ended)

    bg.spawn(sweeper(), "read-plan-sweeper")
    yield
    await bg.close()


def on_unix(request: web.Request) -> asyncio.Transport | None:
    """The request's transport if it is a unix socket's, else None."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if transport is None or sock is None or sock.family != socket.AF_UNIX:
        return None
    return transport


def unix_transport(
    request: web.Request, what: str = "read plans", instead: str = "GET /v1/blocks/{key}"
) -> asyncio.Transport:
    """The request's unix socket transport, else 400 unix_socket_required:
    ``what`` passes descriptors; use ``instead`` elsewhere."""
    transport = on_unix(request)
    if transport is None:
        also = ""
        if what == "read plans" and config_of(request).plan_paths:
            also = ' (or, with plan_paths on, ask for paths: {"paths": true})'
        raise UnixSocketRequired(
            f"{what} pass file descriptors, so they are served on the daemon's unix socket only "
            f"(listen = unix:PATH){also}; use {instead} here"
        )
    return transport


def _taken_over(
    app: web.Application, tenant: str, key: str, p: PlannedBlock | KVStoreError
) -> PlannedBlock | KVStoreError:
    """A key this node misses but holds from a dead node it took over (a
    fleet node, routes/fleet.py): not plannable (its bytes are in the
    bucket), so the client GETs it instead of counting a miss."""
    if isinstance(p, NotFound) and not isinstance(p, TenantNotFound) and adopted_store(app, tenant, key) is not None:
        return NotPlannable(f"key {key!r} is a dead node's, served from the bucket: GET it")
    return p


@routes.post("/v1/read-plan")
async def read_plan(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    body = await json_body(request)
    paths = body.get("paths", False)
    if not isinstance(paths, bool):
        raise InvalidInput(f"field 'paths' must be true or false; got {paths!r}")
    if paths and not config_of(request).plan_paths:
        raise PathsNotOffered(
            "this daemon gives read plans with descriptors only: set plan_paths = true to offer paths "
            "(the data directory must then be mounted at the same path on the client)"
        )
    transport = None if paths else unix_transport(request)
    unknown = set(body) - {"keys", "lease_s", "paths"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    keys = keys_field(body, config_of(request).max_batch_keys, validate=False)
    lease_s = lease_field(body)
    store = store_of(request)
    planned = await store.plan_reads(tenant, keys)
    planned = [_taken_over(request.app, tenant, k, p) for k, p in zip(keys, planned, strict=True)]
    # The client reads these bytes itself, after the answer: charged now.
    ticket_of(request).charge("read", sum(p.size for p in planned if not isinstance(p, KVStoreError)))
    fds: list[int] = []
    try:
        if transport is None:
            return await _path_plan(request, tenant, keys, planned, lease_s)
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
        blocks: list[dict[str, Any]] = []
        segments = set()
        for key, p in zip(keys, planned, strict=True):
            if isinstance(p, KVStoreError):
                blocks.append({"key": key, "status": http_status(p), "error": {"code": p.code, "message": str(p)}})
                continue
            fid = conn.files.get(p.file)
            if fid is None:
                fid = conn.files[p.file] = conn.next_id
                conn.next_id += 1
                files.append(fid)
                # A read-only description of its own: flags the client sets on
                # it (O_APPEND, O_DIRECT) never reach the daemon's descriptor.
                fds.append(os.open(f"/proc/self/fd/{p.segment.fd}", os.O_RDONLY | os.O_CLOEXEC))
            segments.add((p.file[0], p.file[2]))
            blocks.append(_block(tenant, p, fid))
        lease = store.leases.acquire(segments, lease_s)
        conn.leases.add(lease.id)
        if WRITER in request.app:  # a reader: the writer, which compacts and evicts, holds it too
            await share_lease(request.app, lease, lease_s)
        doc = {"lease": lease.id, "expires_in_s": lease_s, "files": files, "closed": closed, "blocks": blocks}
        return await answer_with_fds(request, transport, doc, fds)
    finally:
        for fd in fds:
            os.close(fd)
        for p in planned:
            if isinstance(p, PlannedBlock):
                p.segment.release()


async def _path_plan(
    request: web.Request, tenant: str, keys: list[str], planned: list[PlannedBlock | KVStoreError], lease_s: float
) -> web.Response:
    """A plan with the segment files' paths (any listener): leased for the
    tenant, not the connection; no descriptors."""
    store = store_of(request)
    decode_ok = client_decode_allowed(request.transport)
    entries: list[PlannedBlock | KVStoreError] = []
    for p in planned:
        if isinstance(p, PlannedBlock) and p.record is not None and not decode_ok:
            entries.append(
                InsecureTransport(
                    f"key {p.key!r} is sealed: its record's key goes out only over TLS, a unix socket or "
                    "loopback; GET it (the daemon decodes)"
                )
            )
        else:
            entries.append(p)
    segments = {(p.file[0], p.file[2]) for p in entries if isinstance(p, PlannedBlock)}
    lease = store.leases.acquire(segments, lease_s, owner=tenant)
    if WRITER in request.app:  # a reader: the writer, which compacts and evicts, holds it too
        await share_lease(request.app, lease, lease_s)
    # Held now: a segment still local at this point stays until the lease
    # ends. One compacted or dropped before it was taken is named not_plannable.
    alive = {p.file: store.segment_alive(*p.file) for p in entries if isinstance(p, PlannedBlock)}
    blocks: list[dict[str, Any]] = []
    for key, p in zip(keys, entries, strict=True):
        if isinstance(p, PlannedBlock) and not alive[p.file]:
            p = NotPlannable(f"key {key!r} moved while it was planned: GET it")
        if isinstance(p, KVStoreError):
            blocks.append({"key": key, "status": http_status(p), "error": {"code": p.code, "message": str(p)}})
            continue
        blocks.append(_block(tenant, p, os.path.abspath(p.segment.path)))
    doc = {"lease": lease.id, "expires_in_s": lease_s, "files": [], "closed": [], "blocks": blocks}
    return web.json_response(doc, headers={"Kvstore-Fds": "0"}, dumps=_dumps)


def _dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _block(tenant: str, p: PlannedBlock, where: int | str) -> dict[str, Any]:
    """A planned block's entry: ``where`` is its file's id on the connection
    (an int) or its path (a str)."""
    doc: dict[str, Any] = {
        "key": p.key,
        "status": 200,
        "file" if isinstance(where, int) else "path": where,
        "offset": p.offset,
        "size": p.size,
        "frame_size": p.frame_size,
        "xxh3": [f"{c:016x}" for c in p.checksums],
    }
    if p.record is not None:  # sealed: the stored frames start at offset; the client opens them
        doc["record"] = record_meta(tenant, p.key, p.size, 0, p.size, p.record)
    return doc


async def answer_with_fds(
    request: web.Request, transport: asyncio.Transport, doc: dict[str, Any], fds: list[int]
) -> web.StreamResponse:
    """A plan's answer: ``doc`` as JSON, its first bytes carrying ``fds``
    (SCM_RIGHTS; ``Kvstore-Fds`` says how many)."""
    payload = json.dumps(doc, separators=(",", ":")).encode()
    resp = web.StreamResponse(headers={"Content-Type": "application/json", "Kvstore-Fds": str(len(fds))})
    resp.content_length = len(payload)
    await resp.prepare(request)
    await _send_with_fds(request, resp, transport, payload, fds)
    await resp.write_eof()
    return resp


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
    tenant = tenant_of(request)
    lease_id = request.match_info["lease"]
    transport = on_unix(request)
    if transport is not None and request.app[PLANS].release(transport, lease_id):
        return web.Response(status=204)  # a descriptor plan's, held by this connection
    if not config_of(request).plan_paths:
        unix_transport(request)  # descriptor plans only: over TCP, 400 as ever
        raise NotFound("no such lease on this connection (released, expired, or never given)")
    if not await _release_owned_lease(request, tenant, lease_id):
        raise NotFound(
            "no such lease: released, expired, never given, another tenant's, or a descriptor plan's "
            "(those are released on the connection that holds them)"
        )
    return web.Response(status=204)


@routes.delete("/v1/leases/{lease}")
async def release_lease(request: web.Request) -> web.Response:
    """A lease the tenant owns (a lookup's lock, a path plan's), from any
    connection, listener or worker."""
    tenant = tenant_of(request)
    if not await _release_owned_lease(request, tenant, request.match_info["lease"]):
        raise LeaseNotFound("no such lease of this tenant: released, expired, or never given")
    return web.Response(status=204)


async def _release_owned_lease(request: web.Request, tenant: str, lease_id: str) -> bool:
    """Release a lease ``tenant`` owns. On a reader worker the writer
    decides: it holds every owned lease any worker granted (share_lease), so
    the lease is released whichever worker this connection landed on."""
    mine = request.app[PLANS].release_owned_lease(tenant, lease_id)
    if WRITER not in request.app:
        return mine
    headers = {"Authorization": request.headers.get("Authorization", "")}
    try:
        async with request.app[WRITER].delete(
            writer_url(request), headers=headers, timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            theirs = r.status == 204
    except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
        if not mine:
            raise StoreClosed(f"the writer process is unavailable ({type(e).__name__}); retry") from None
        theirs = False  # released here; the relay tells the writer
    return mine or theirs
