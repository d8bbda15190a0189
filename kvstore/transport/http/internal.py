"""Calls between the workers of one daemon, over the writer's unix socket.

Reader workers serve reads, but the writer owns access times (the quota's LRU
order and the TTL, access.py) and runs compaction and eviction: every
``RELAY_S`` a reader hands the writer the accesses it served and the read
plans' leases it released, and it gives the writer each lease as it grants
it, so the writer keeps the plan's segments in place too. The routes exist
only on the writer and answer only on
the workers' private unix socket (in a 0700 directory only the daemon's user
can reach); on TCP and on the public unix sockets (``listen = unix:PATH``) it
is a 404 like any unknown path. They are not part of the API (docs/openapi.yaml
leaves out /_internal/).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from kvstore import touchbells
from kvstore.engine.api import Lease
from kvstore.errors import InvalidInput, NotFound
from kvstore.transport.http.appkeys import STATE, STORE, store_of
from kvstore.transport.http.forward import WRITER

log = logging.getLogger("kvstore.http.internal")
PREFIX = "/_internal/"
RELAY_S = 1.0
routes = web.RouteTableDef()
# The writer's ringer, and a reader's bell (kvstore/touchbells.py): the readers'
# accesses handed over at once when the quota is about to pick victims.
RINGER = web.AppKey("ringer", touchbells.Ringer)
BELL = web.AppKey("bell", touchbells.Bell)


def on_private_socket(request: web.Request) -> bool:
    """Whether ``request`` came over the workers' private socket (never a
    public ``unix:PATH`` listener, whose clients are tenants)."""
    return private_socket(request.app, request.transport)


def private_socket(app: web.Application, transport: asyncio.BaseTransport | None) -> bool:
    """Whether ``transport`` is a connection on the workers' private socket:
    a reader worker's (:func:`on_private_socket`)."""
    state = app.get(STATE)
    private = state.get("writer_socket") if state is not None else None
    return transport is not None and private is not None and transport.get_extra_info("sockname") == private


@routes.post("/_internal/touches")
async def touches(request: web.Request) -> web.Response:
    if not on_private_socket(request):
        raise NotFound("no such route")
    doc = _json_object(await request.read(), "touches")
    if not all(
        isinstance(keys, dict) and all(isinstance(k, str) and isinstance(t, int) for k, t in keys.items())
        for keys in doc.values()
    ):
        raise InvalidInput("touches: expected {tenant: {key: unix ms}}")
    store_of(request).absorb_touches(doc)
    ringer = request.app.get(RINGER)
    reader, taken = request.query.get("reader"), request.query.get("taken")
    if ringer is not None and reader is not None and taken is not None:  # an answer to the writer's ring
        try:
            ringer.answered(int(reader), int(taken))
        except ValueError:
            raise InvalidInput("touches: reader and taken are integers") from None
    return web.Response(status=204)


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidInput(f"{what}: not JSON") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{what}: not an object")
    return doc


@routes.post("/_internal/leases")
async def hold_lease(request: web.Request) -> web.Response:
    """A reader's read-plan lease, held here under the same id (and, for a
    plan with paths, for the same tenant, who may release it here). A
    lookup's lock (``blocks``, of the owning tenant) is locked here as on
    the reader; the answer names the keys locked (``{"locked": [key, ...]}``):
    one removed here between the reader's lookup and this pin is left out."""
    if not on_private_socket(request):
        raise NotFound("no such route")
    doc = _json_object(await request.read(), "leases")
    lid, segs, ttl, owner = doc.get("id"), doc.get("segments"), doc.get("ttl_s"), doc.get("tenant")
    blocks = doc.get("blocks", [])
    if (
        not isinstance(lid, str)
        or not isinstance(ttl, int | float)
        or not (owner is None or isinstance(owner, str))
        or not _pairs(segs, int)
        or not _pairs(blocks, str)
        or (blocks and not all(t == owner for t, _ in blocks))
    ):
        raise InvalidInput(
            'leases: expected {"id": str, "segments": [[tenant, id], ...], "ttl_s": number, "tenant"?: str, '
            '"blocks"?: [[tenant, key], ...] (of "tenant")}'
        )
    assert isinstance(segs, list) and isinstance(blocks, list)  # checked by _pairs
    store = store_of(request)
    segments = [(t, sid) for t, sid in segs]
    if not blocks:
        store.leases.acquire(segments, float(ttl), lid, owner)
        return web.Response(status=204)
    assert owner is not None  # checked above: the blocks are its
    lease = await store.lock(lid, owner, [k for _, k in blocks], float(ttl), segments)
    return web.json_response({"locked": sorted(k for _, k in lease.blocks) if lease is not None else []})


def _pairs(value: Any, second: type) -> bool:
    """``value`` is a list of [str, ``second``] pairs."""
    return isinstance(value, list) and all(
        isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], second) for x in value
    )


@routes.post("/_internal/leases/release")
async def release_leases(request: web.Request) -> web.Response:
    if not on_private_socket(request):
        raise NotFound("no such route")
    ids = _json_object(await request.read(), "lease release").get("ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise InvalidInput('lease release: expected {"ids": [str, ...]}')
    for lid in ids:
        store_of(request).leases.release(lid)
    return web.Response(status=204)


async def share_lease(app: web.Application, lease: Lease, ttl_s: float) -> frozenset[str] | None:
    """A reader: have the writer hold ``lease`` too, before the plan (or the
    lookup that locked blocks) is sent. For a lock, the keys the writer
    locked too (it leaves out one it removed since the reader's lookup);
    None for a plan, or when the writer could not be reached.
    If the writer cannot be reached the plan is sent all the same, without
    the writer's pin (logged): descriptors keep their bytes; a path read may
    then find its file compacted away, which fails (ENOENT) or fails the
    frame checksums, never returns other bytes."""
    doc: dict[str, Any] = {"id": lease.id, "segments": sorted(lease.segments), "ttl_s": ttl_s}
    if lease.owner is not None:  # a plan with paths, a lookup's lock: its tenant may release it on any worker
        doc["tenant"] = lease.owner
    if lease.blocks:  # a lookup's lock: the writer evicts and expires, so it must know the pins
        doc["blocks"] = sorted(lease.blocks)
    try:
        async with app[WRITER].post(
            "http://writer/_internal/leases", json=doc, timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            if r.status == 204:
                return None
            if r.status == 200:
                return _locked_keys(await r.json())
            log.warning("the writer refused a lease: %s", r.status)
    except (aiohttp.ClientError, ConnectionError, TimeoutError, ValueError) as e:
        log.warning("the writer did not take a lease: %s", type(e).__name__)
    return None


def _locked_keys(doc: Any) -> frozenset[str] | None:
    """The writer's answer to a lock: ``{"locked": [key, ...]}``."""
    keys = doc.get("locked") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        log.warning("the writer answered a lock with no list of keys")
        return None
    return frozenset(keys)


async def relay(app: web.Application, session: aiohttp.ClientSession) -> None:
    """A reader: every ``RELAY_S``, and at once when the writer rings its
    bell (touchbells.py), hand the writer the accesses served here and the
    read-plan leases released here. An answer to a ring says how many rings
    this reader had taken before it drained its accesses, even with none."""
    bell = app.get(BELL)
    rung = asyncio.Event()
    loop = asyncio.get_running_loop()
    if bell is not None:
        bell.listen(loop, rung.set)
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rung.wait(), RELAY_S)
            rung.clear()
            taken = bell.taken if bell is not None else 0
            pending = app[STORE].touches()
            released = app[STATE]["released_leases"]
            app[STATE]["released_leases"] = []
            answer = f"?reader={bell.index}&taken={taken}" if bell is not None and taken else ""
            for path, doc in (
                ("touches" + answer, pending if pending or answer else None),
                ("leases/release", {"ids": released} if released else None),
            ):
                if doc is None:
                    continue
                with contextlib.suppress(aiohttp.ClientError, ConnectionError, TimeoutError):
                    async with session.post(
                        f"http://writer/_internal/{path}", json=doc, timeout=aiohttp.ClientTimeout(total=10)
                    ) as r:
                        if r.status != 204:
                            log.warning("the writer refused %s: %s", path, r.status)
    finally:
        if bell is not None:
            bell.stop(loop)
