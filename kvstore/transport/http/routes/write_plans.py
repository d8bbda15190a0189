"""Write plans: a client on this host writes direct blocks into the
tenant's segment itself, then commits them (engine/store_write_plans.py).

``POST /v1/write-plan`` ``{"blocks": [{"key", "size", "meta"?}], "lease_s"?}``
(unix socket only) reserves room for each new key and answers, per block,
the file (an id in this answer's ``files``), the ``offset`` where its bytes
go, the ``length`` to write there (the block, then zeros up to a 4096
multiple: ``O_DIRECT`` writes fit it) and the ``frame_size`` its checksums
are taken over; ``direct`` says whether to write with ``O_DIRECT`` (as the
daemon writes those segments: its ``direct_io`` setting and the
filesystem); a key that exists is ``"exists": true`` with its ETag,
nothing to write. The files' descriptors (opened write-only for this answer,
one per segment; the client may set ``O_DIRECT`` on them and closes them
when the plan ends) travel with the answer's body as SCM_RIGHTS, in the
order of ``files``, as a read plan's do.

``POST /v1/write-plan/{plan}`` ``{"blocks": [{"key", "xxh3": [hex per
frame]}]}`` commits: each block's bytes are read back and checked, then
indexed and synced like a PUT's; per block ``201`` with its ETag, or the
error (``422 checksum_mismatch``). Keys left out are abandoned; the plan ends.
``DELETE /v1/write-plan/{plan}`` abandons it. A plan not committed within
``lease_s`` (default 30) ends by itself, and so do the plans of a connection
that closes. Commit and abandon work on any connection of the tenant.

With several workers the writer reserves (the plan comes back to the worker
holding the connection with the files' paths, over the workers' private
socket) and that worker opens the files and passes them on.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.engine.api import CODEC_NAMES, FrameEntry, Stored
from kvstore.errors import InsecureTransport, InvalidInput, KVStoreError, StoreClosed, UnixSocketRequired
from kvstore.events.model import BlockMeta
from kvstore.transport.http.appkeys import config_of, store_of
from kvstore.transport.http.auth import tenant_of
from kvstore.transport.http.bodies import block_body, json_body, lease_field
from kvstore.transport.http.forward import WRITER, writer_url
from kvstore.transport.http.internal import on_private_socket
from kvstore.transport.http.qos import ticket_of
from kvstore.transport.http.routes.fleet import refuse_misplaced
from kvstore.transport.http.routes.plans import PLANS, answer_with_fds, on_unix, unix_transport
from kvstore.transport.http.routes.records import client_decode_allowed
from kvstore.transport.statuses import item_answer

routes = web.RouteTableDef()


def _blocks_field(body: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    blocks = body.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise InvalidInput("field 'blocks' must be a non-empty list of objects")
    if len(blocks) > limit:
        raise InvalidInput(f"field 'blocks' has {len(blocks)} items; the maximum is {limit}")
    for i, b in enumerate(blocks):
        if not isinstance(b, dict):
            raise InvalidInput(f"blocks[{i}] must be an object")
        if not isinstance(b.get("key"), str):
            raise InvalidInput(f"blocks[{i}].key must be a string")
    return blocks


@routes.post("/v1/write-plan")
async def write_plan(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    private = on_private_socket(request)  # a reader worker relays it: answer paths
    transport = None if private else on_unix(request)
    if not private and transport is None:
        return await _upload_plan(request, tenant)
    body = await _plan_body(request)
    if WRITER not in request.app:  # the client writes the files itself: its bytes now
        blocks = body.get("blocks")
        sizes = [b.get("size") for b in blocks if isinstance(b, dict)] if isinstance(blocks, list) else []
        n = sum(s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0)
        ticket = ticket_of(request)
        await ticket.reserve("write", n)
        ticket.served("write", n)
    reserved = await _reserve(request, tenant, body)
    if isinstance(reserved, web.Response):
        return reserved
    doc = reserved
    if private:
        return web.json_response(doc, dumps=_dumps)
    assert transport is not None
    # The files by path, opened write-only for this answer (a description of
    # its own: O_DIRECT set on it by the client never reaches the daemon's).
    paths: list[str] = doc.pop("paths")
    fds: list[int] = []
    try:
        for p in paths:
            fds.append(os.open(p, os.O_WRONLY | os.O_CLOEXEC))
        request.app[PLANS].connection(transport).write_plans.add(doc["plan"])
        doc["files"] = list(range(len(fds)))
        return await answer_with_fds(request, transport, doc, fds)
    except BaseException:
        with contextlib.suppress(KVStoreError, aiohttp.ClientError, OSError):
            await _abandon(request, tenant, doc["plan"])
        raise
    finally:
        for fd in fds:
            os.close(fd)


async def _plan_body(request: web.Request) -> dict[str, Any]:
    body = await json_body(request)
    unknown = set(body) - {"blocks", "lease_s", "encode"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    return body


async def _upload_plan(request: web.Request, tenant: str) -> web.Response:
    """A plan over TCP or TLS: only for records the client seals itself
    (encode=client, where a record's key may go), whose bytes then come as
    request bodies (``PUT /v1/write-plan/{plan}/blocks/{key}``): a direct
    block gains nothing over ``POST /v1/batch/put`` there."""
    body = await _plan_body(request)
    if body.get("encode") != "client":
        unix_transport(request, "write plans", "PUT /v1/blocks/{key} or POST /v1/batch/put")
    if not client_decode_allowed(request.transport):
        raise InsecureTransport(
            "a record's own key goes out only over TLS, a unix socket or loopback: PUT the blocks "
            "(the daemon seals them) on this connection"
        )
    if store_of(request).plans_writes(tenant):
        raise UnixSocketRequired(
            "write plans of a direct tenant pass file descriptors, so they are served on the daemon's unix "
            "socket only; use POST /v1/batch/put here"
        )
    reserved = await _reserve(request, tenant, body)
    if isinstance(reserved, web.Response):
        return reserved
    doc = reserved
    doc.pop("paths", None)
    for b in doc["blocks"]:
        b.pop("file", None)
    doc["files"] = []
    return web.json_response(doc, headers={"Kvstore-Fds": "0"}, dumps=_dumps)


async def _reserve(request: web.Request, tenant: str, body: dict[str, Any]) -> dict[str, Any] | web.Response:
    """The plan, with each file's path in ``paths``: reserved here (the
    writer), or by the writer for a reader worker (its error answer passed on)."""
    if WRITER in request.app:
        return await _relay(request, json.dumps(body).encode())
    return await _plan(request, tenant, body)


async def _plan(request: web.Request, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
    """Reserve (the writer); the answer with each file's path in ``paths``."""
    blocks = _blocks_field(body, config_of(request).max_batch_keys)
    items: list[tuple[str, int]] = []
    metas: dict[str, BlockMeta] = {}
    for i, b in enumerate(blocks):
        unknown = set(b) - {"key", "size", "meta"}
        if unknown:
            raise InvalidInput(f"blocks[{i}]: unknown field(s): {', '.join(sorted(unknown))}")
        size = b.get("size")
        if isinstance(size, bool) or not isinstance(size, int):
            raise InvalidInput(f"blocks[{i}].size must be an integer number of bytes")
        items.append((b["key"], size))
        if "meta" in b:
            if not isinstance(b["meta"], str):
                raise InvalidInput(f"blocks[{i}].meta must be a string (Kvstore-Block-Meta's value)")
            try:
                metas[b["key"]] = BlockMeta.from_header(b["meta"])
            except InvalidInput as e:
                raise InvalidInput(f"blocks[{i}].meta: {e}") from None
    lease_s = lease_field(body)
    refuse_misplaced(request, [key for key, _ in items])  # a fleet node plans only its own keys
    plan = await store_of(request).plan_writes(tenant, items, lease_s, metas, body.get("encode", "server"))
    paths: list[str] = []
    out: list[dict[str, Any]] = []
    for key, _ in items:
        if key in plan.existing:
            out.append({"key": key, "status": 200, "exists": True, "etag": plan.existing[key].info.etag})
            continue
        if key in plan.declined:  # its tenant's admission: nothing to write
            out.append(item_answer(key, plan.declined[key]))
            continue
        w = plan.writes[key]
        if w.path not in paths:
            paths.append(w.path)
        out.append(
            {
                "key": key,
                "status": 200,
                "file": paths.index(w.path),
                "offset": w.offset,
                "length": w.length,
                "size": w.size,
                "frame_size": w.frame_size,
            }
        )
        if w.sealing is not None:  # the client seals the frames: this record's identity and its own key
            sl = w.sealing
            out[-1]["record"] = {
                "tenant": tenant,
                "record_id": sl.record_id.hex(),
                "key_version": sl.key_version,
                "frame_count": len(w.reservation.header.frames),
                "frame_key": base64.b64encode(sl.frame_key).decode(),
                "compression": sl.compression,
                "level": sl.level,
            }
    # Whether the daemon writes these segments with O_DIRECT (direct_io and
    # the filesystem): the client writes the same way.
    direct = all(w.reservation.direct for w in plan.writes.values())
    return {"plan": plan.id, "expires_in_s": lease_s, "direct": direct, "paths": paths, "blocks": out}


async def _relay(request: web.Request, raw: bytes) -> dict[str, Any] | web.Response:
    """A reader worker: the writer reserves; its answer (with paths) comes
    back, or its error answer, passed on as it is."""
    headers = {"Authorization": request.headers.get("Authorization", ""), "Content-Type": "application/json"}
    try:
        async with request.app[WRITER].post(
            writer_url(request), data=raw, headers=headers, timeout=aiohttp.ClientTimeout(total=60)
        ) as r:
            body = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=body, content_type="application/json")
    except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
        raise StoreClosed(f"the writer process is unavailable ({type(e).__name__}); retry") from None
    doc: dict[str, Any] = json.loads(body)
    return doc


@routes.post("/v1/write-plan/{plan}")
async def commit_plan(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    plan_id = request.match_info["plan"]
    body = await json_body(request)
    unknown = set(body) - {"blocks"}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    written: dict[str, list[FrameEntry | int]] = {}
    for i, b in enumerate(_blocks_field(body, config_of(request).max_batch_keys)):
        extra = set(b) - {"key", "xxh3", "frames"}
        if extra:
            raise InvalidInput(f"blocks[{i}]: unknown field(s): {', '.join(sorted(extra))}")
        if b["key"] in written:
            raise InvalidInput(f"blocks[{i}]: key {b['key']!r} appears twice")
        if ("xxh3" in b) == ("frames" in b):
            raise InvalidInput(
                f"blocks[{i}] needs 'xxh3' (a direct block) or 'frames' (sealed by the client), not both"
            )
        written[b["key"]] = _frames(b["frames"], i) if "frames" in b else _sums(b["xxh3"], i)
    done = await store_of(request).commit_writes(tenant, plan_id, written)
    out: list[dict[str, Any]] = []
    for key in written:
        r = done[key]
        if isinstance(r, Stored):
            out.append({"key": key, "status": 201 if r.created else 200, "etag": r.info.etag})
        else:
            out.append(item_answer(key, r))
    return web.json_response({"blocks": out}, dumps=_dumps)


def _hex64(x: object) -> int:
    if not isinstance(x, str) or len(x) != 16:
        raise ValueError(x)
    return int(x, 16)


def _sums(xs: object, i: int) -> list[FrameEntry | int]:
    if xs is None:
        return []  # none given (a GPU source): the daemon takes them from what landed
    try:
        if not isinstance(xs, list) or not xs:
            raise ValueError(xs)
        return [_hex64(x) for x in xs]
    except ValueError:
        raise InvalidInput(f"blocks[{i}].xxh3 must be a list of 16-digit hex strings, one per frame") from None


_CODEC_IDS = {name: cid for cid, name in CODEC_NAMES.items()}


def _frames(fs: object, i: int) -> list[FrameEntry | int]:
    what = f'blocks[{i}].frames must be a list of {{"len", "codec", "xxh3"}}, one per frame'
    if not isinstance(fs, list) or not fs:
        raise InvalidInput(what)
    out: list[FrameEntry | int] = []
    for j, f in enumerate(fs):
        if not isinstance(f, dict) or set(f) != {"len", "codec", "xxh3"}:
            raise InvalidInput(what)
        n, codec = f["len"], _CODEC_IDS.get(f["codec"]) if isinstance(f["codec"], str) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or codec is None:
            raise InvalidInput(
                f"blocks[{i}].frames[{j}]: 'len' must be a byte count, 'codec' one of {sorted(_CODEC_IDS)}"
            )
        try:
            out.append(FrameEntry(n, codec, _hex64(f["xxh3"])))
        except ValueError:
            raise InvalidInput(f"blocks[{i}].frames[{j}].xxh3 must be 16 hex digits") from None
    return out


@routes.put("/v1/write-plan/{plan}/blocks/{key}")
async def upload_block(request: web.Request) -> web.Response:
    """The stored bytes of one block of a plan, for a client that cannot
    write the segment file itself (a plan over TCP or TLS)."""
    tenant = tenant_of(request)
    key = request.match_info["key"]
    store = store_of(request)
    plan_id = request.match_info["plan"]
    w = store.write_plan(tenant, plan_id).writes.get(key)  # 404 before the body is read
    if w is None:
        raise InvalidInput(
            f"key {key!r} is not in write plan {plan_id} (or it exists, or was not admitted: nothing to write)"
        )
    async with block_body(request, w.length) as data:
        await store.upload_planned(tenant, plan_id, key, data)
    return web.Response(status=204)


@routes.delete("/v1/write-plan/{plan}")
async def abandon_plan(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    await store_of(request).abandon_writes(tenant, request.match_info["plan"])
    return web.Response(status=204)


async def _abandon(request: web.Request, tenant: str, plan_id: str) -> None:
    if WRITER not in request.app:
        await store_of(request).abandon_writes(tenant, plan_id)
        return
    headers = {"Authorization": request.headers.get("Authorization", "")}
    url = writer_url(request).with_path(f"/v1/write-plan/{plan_id}")
    async with request.app[WRITER].delete(url, headers=headers, timeout=aiohttp.ClientTimeout(total=10)):
        pass


def _dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))
