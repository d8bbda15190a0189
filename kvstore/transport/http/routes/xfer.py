"""``/v1/xfer/*``: NIXL transfers, the control calls (bodies are JSON).

- ``POST /v1/xfer/agents`` ``{"name", "metadata": base64}``: introduce the
  client's agent; answers the daemon's ``{"name", "metadata"}``.
- ``POST /v1/xfer/read`` ``{"agent", "keys", "checksums"?, "release"?}``:
  where each block's bytes are in the daemon's agent, under a lease; the
  client READs them. ``checksums``: each block carries its frames' xxh3 for
  the client to verify; ``release``: leases of earlier reads to end first.
- ``POST /v1/xfer/release`` ``{"lease"}``: ``204``; ``404 lease_not_found``
  when it had expired (the client discards what it read under it).
  ``{"leases": [...]}``: ends those still held, ``204`` whatever they were.
- ``POST /v1/xfer/write`` ``{"agent", "metadata"?, "blocks": [{"key",
  "addr", "len", "dev", "meta"?}]}``: the daemon READs each block from the
  client's memory and stores it as a PUT would (``meta``: the block's
  engine identity, as ``Kvstore-Block-Meta``'s JSON).

One agent serves the daemon: the writer's (single or writer role). Reader
workers relay these routes to it like every write (see transport/http/forward.py).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import web

from kvstore.errors import InvalidInput, NixlDisabled
from kvstore.events.model import BlockMeta
from kvstore.names import validate_key
from kvstore.transport.http.appkeys import config_of
from kvstore.transport.http.auth import tenant_of
from kvstore.transport.http.bodies import json_body, keys_field
from kvstore.transport.http.qos import ticket_of
from kvstore.transport.http.routes.fleet import refuse_misplaced
from kvstore.transport.nixl.service import XferService

routes = web.RouteTableDef()
XFER = web.AppKey("xfer", XferService)
NAME_MAX = 256


def _service(request: web.Request) -> XferService:
    if XFER not in request.app:
        raise NixlDisabled("this daemon runs no NIXL agent (nixl = false): read and write over HTTP")
    return request.app[XFER]


def _fields(body: dict[str, Any], required: set[str], optional: frozenset[str] = frozenset()) -> None:
    unknown = set(body) - required - optional
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    missing = required - set(body)
    if missing:
        raise InvalidInput(f"missing field(s): {', '.join(sorted(missing))}")


def _name(body: dict[str, Any], field: str) -> str:
    value = body[field]
    if not isinstance(value, str) or not 0 < len(value) <= NAME_MAX:
        raise InvalidInput(f"field {field!r} must be an agent name of 1 to {NAME_MAX} characters")
    return value


def _b64(body: dict[str, Any], field: str) -> bytes:
    value = body[field]
    try:
        if not isinstance(value, str):
            raise ValueError
        return base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        raise InvalidInput(f"field {field!r} must be base64 text") from None


def _uint(block: dict[str, Any], field: str, i: int, limit: int) -> int:
    value = block.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise InvalidInput(f"field 'blocks[{i}].{field}' must be an integer in [0, {limit}]; got {value!r}")
    return value


@routes.post("/v1/xfer/agents")
async def register_agent(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    service = _service(request)
    body = await json_body(request)
    _fields(body, {"name", "metadata"})
    name = _name(body, "name")
    ours = service.register(tenant, name, _b64(body, "metadata"))
    return web.json_response({"name": service.name, "metadata": base64.b64encode(ours).decode()})


@routes.post("/v1/xfer/read")
async def xfer_read(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    service = _service(request)
    body = await json_body(request)
    _fields(body, {"agent", "keys"}, frozenset({"checksums", "release"}))
    agent = _name(body, "agent")
    limit = config_of(request).max_batch_keys
    keys = keys_field(body, limit, validate=False)
    checksums = body.get("checksums", False)
    if not isinstance(checksums, bool):
        raise InvalidInput("field 'checksums' must be true or false")
    release = _leases(body, "release", limit) if "release" in body else []
    answer = await service.read(tenant, agent, keys, checksums, release)
    # The peer pulls these bytes after the answer: charged now.
    ticket_of(request).charge("read", sum(int(b.get("size", 0)) for b in answer["blocks"] if b.get("status") == 200))
    return web.json_response(answer)


def _leases(body: dict[str, Any], field: str, limit: int) -> list[str]:
    value = body[field]
    if (
        not isinstance(value, list)
        or len(value) > limit
        or not all(isinstance(v, str) and 0 < len(v) <= NAME_MAX for v in value)
    ):
        raise InvalidInput(f"field {field!r} must be a list of at most {limit} lease strings")
    return value


@routes.post("/v1/xfer/release")
async def xfer_release(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    service = _service(request)
    body = await json_body(request)
    if "leases" in body:
        _fields(body, {"leases"})
        for lease_id in _leases(body, "leases", config_of(request).max_batch_keys):
            service.release_quietly(tenant, lease_id)
        return web.Response(status=204)
    _fields(body, {"lease"})
    lease = body["lease"]
    if not isinstance(lease, str) or not 0 < len(lease) <= NAME_MAX:
        raise InvalidInput("field 'lease' must be the lease string a read answered")
    service.release(tenant, lease)
    return web.Response(status=204)


@routes.post("/v1/xfer/write")
async def xfer_write(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    service = _service(request)
    config = config_of(request)
    body = await json_body(request)
    _fields(body, {"agent", "blocks"}, frozenset({"metadata"}))
    agent = _name(body, "agent")
    metadata = _b64(body, "metadata") if body.get("metadata") else None
    raw = body["blocks"]
    if not isinstance(raw, list) or not raw or len(raw) > config.max_batch_keys:
        raise InvalidInput(f"field 'blocks' must be a list of 1 to {config.max_batch_keys} blocks")
    blocks: list[tuple[str, int, int, int]] = []
    metas: list[BlockMeta | None] = []
    for i, b in enumerate(raw):
        if not isinstance(b, dict) or set(b) - {"key", "addr", "len", "dev", "meta"}:
            raise InvalidInput(f"field 'blocks[{i}]' must be an object with key, addr, len, dev (and meta)")
        metas.append(BlockMeta.from_doc(b["meta"], f"field 'blocks[{i}].meta'") if "meta" in b else None)
        try:
            key = validate_key(b.get("key"))
        except InvalidInput as e:
            raise InvalidInput(f"field 'blocks[{i}].key': {e}") from None
        blocks.append(
            (
                key,
                _uint(b, "addr", i, (1 << 64) - 1),
                _uint(b, "len", i, config.store.max_block_size),
                _uint(b, "dev", i, (1 << 32) - 1),
            )
        )
    refuse_misplaced(request, [b[0] for b in blocks])  # a fleet node stores only its own keys
    ticket = ticket_of(request)  # the bytes from the tenant's write limit before they are pulled
    n = sum(b[2] for b in blocks)
    await ticket.reserve("write", n)
    ticket.served("write", n)
    return web.json_response({"results": await service.write(tenant, agent, metadata, blocks, metas)})
