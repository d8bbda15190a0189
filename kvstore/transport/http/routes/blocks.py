"""Block routes: PUT/GET/HEAD/DELETE /v1/blocks/{key}, lookup, stats.

GET follows RFC 9110: a strong ETag (the stored record's id) with
If-None-Match -> 304 (§13.1.2), a Range of one range-spec -> 206 with
Content-Range (§14), several range-specs -> 200 with the whole block (allowed
by §14.2; whether or not the block satisfies more than one of them), no
satisfiable range -> 416 with ``Content-Range: bytes */size`` (§15.5.17), and
a malformed Range header ignored (§14.2).
"""

from __future__ import annotations

import uuid

from aiohttp import web

from kvstore.engine.api import BlockInfo, DirectExtent, Store
from kvstore.errors import InvalidInput, NotAdmitted, NotFound, TenantNotFound
from kvstore.events.model import META_HEADER, BlockMeta
from kvstore.names import validate_client_key, validate_key
from kvstore.transport.http.appkeys import RESOLVED, config_of, store_of
from kvstore.transport.http.auth import tenant_of
from kvstore.transport.http.bodies import block_body, json_body, keys_field, lease_field, tokens_per_block_field
from kvstore.transport.http.forward import WRITER
from kvstore.transport.http.internal import share_lease
from kvstore.transport.http.qos import ticket_of
from kvstore.transport.http.query import query_int, query_value
from kvstore.transport.http.ranges import etag_matches, parse_range, range_spec_count
from kvstore.transport.http.respond import send
from kvstore.transport.http.routes.fleet import adopted_store, with_adopted
from kvstore.transport.http.sendfile import send_extent
from kvstore.transport.statuses import http_status

routes = web.RouteTableDef()


def etag(record_etag: str) -> str:
    return f'"{record_etag}"'


@routes.put("/v1/blocks/{key}")
async def put_block(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    key = validate_client_key(request.match_info["key"])
    store = store_of(request)
    raw_meta = request.headers.get(META_HEADER)
    meta = BlockMeta.from_header(raw_meta) if raw_meta is not None else None
    async with block_body(request, store.config.max_block_size) as data:
        try:
            stored = await store.put(tenant, key, data, meta)
        except NotAdmitted as e:  # its tenant's admit_after: nothing stored, no ETag
            return web.json_response(e.answer(), status=http_status(e))
    return web.json_response(
        {"key": key, "size": stored.info.size, "created": stored.created},
        status=201 if stored.created else 200,
        headers={"ETag": etag(stored.info.etag)},
    )


@routes.get("/v1/blocks/{key}", allow_head=False)
async def get_block(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    key = validate_key(request.match_info["key"])
    store, info = await head_anywhere(request, tenant, key)
    headers = {"ETag": etag(info.etag), "Accept-Ranges": "bytes"}
    if etag_matches(request.headers.get("If-None-Match"), headers["ETag"]):
        return web.Response(status=304, headers=headers)
    header = request.headers.get("Range")
    ranges = parse_range(header, info.size)  # 416 when none is satisfiable
    one = ranges is not None and range_spec_count(header) == 1
    await take_read(request, ranges[0].end - ranges[0].start if ranges is not None and one else info.size)
    if ranges is not None and one:
        r = ranges[0]
        data = await store.get_sendable(tenant, key, r.start, r.end, info)  # one index lookup per GET
        headers["Content-Range"] = r.content_range(info.size)
        status = 206
    else:
        data = await store.get_sendable(tenant, key, info=info)
        status = 200
    try:
        return await send_bytes(request, data, status, headers)
    finally:
        if isinstance(data, DirectExtent):
            data.release()  # its segment stays open until the answer is sent


async def head_anywhere(request: web.Request, tenant: str, key: str) -> tuple[Store, BlockInfo]:
    """The store that holds the block and its head: this node's, or on a
    fleet node, a dead node's it took over (routes/fleet.py). Raises the
    local store's NotFound where neither has it. A read the fast lane
    resolved and handed over goes on from what it found (connection.py)."""
    store = store_of(request)
    resolved = request.get(RESOLVED)
    try:
        if resolved is not None and resolved.key == key:
            if resolved.missing is not None:
                raise resolved.missing
            if resolved.info is not None:
                return store, resolved.info
        return store, store.resolve(tenant, key)
    except TenantNotFound:
        raise
    except NotFound:
        other = adopted_store(request.app, tenant, key)
        if other is None:
            raise
        return other, await other.head(tenant, key)


async def take_read(request: web.Request, n: int) -> None:
    """``n`` bytes from the tenant's read limit before they are read (kvstore/qos/admission.py)."""
    await ticket_of(request).reserve("read", n)


async def send_bytes(
    request: web.Request,
    data: bytes | bytearray | memoryview | DirectExtent,
    status: int,
    headers: dict[str, str],
    head: bytes = b"",
    content_type: str = "application/octet-stream",
) -> web.StreamResponse:
    """Send ``head`` then ``data`` with a Content-Length: a buffer handed to
    the transport as it is (no copy into a payload object), or a local
    segment's extent with sendfile from its file."""
    size = len(head) + (len(data.view) if isinstance(data, DirectExtent) else len(data))
    ticket_of(request).moved("out", size)
    resp = web.StreamResponse(status=status, headers={**headers, "Content-Type": content_type})
    resp.content_length = size
    await resp.prepare(request)
    if head:
        await send(request, resp, head)
    if isinstance(data, DirectExtent):
        await send_extent(request, resp, data, config_of(request).sendfile)
    else:
        await send(request, resp, data)
    await resp.write_eof()
    return resp


@routes.head("/v1/blocks/{key}")
async def head_block(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    key = validate_key(request.match_info["key"])
    _, info = await head_anywhere(request, tenant, key)
    headers = {"ETag": etag(info.etag), "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    if etag_matches(request.headers.get("If-None-Match"), headers["ETag"]):
        return web.Response(status=304, headers=headers)
    resp = web.StreamResponse(status=200, headers=headers)
    resp.content_length = info.size
    return resp


@routes.delete("/v1/blocks/{key}")
async def delete_block(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    key = validate_client_key(request.match_info["key"])
    if not await store_of(request).delete(tenant, key):
        raise NotFound(f"key {key!r} not found")
    return web.Response(status=204)


@routes.post("/v1/lookup")
async def lookup(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    body = await json_body(request)
    keys = keys_field(body, config_of(request).max_lookup_keys, validate=False)
    tpb = tokens_per_block_field(body)
    if "lease_s" not in body:
        r = await store_of(request).lookup(tenant, keys, tpb)
        present = with_adopted(request.app, tenant, list(keys), r.present)
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        return web.json_response({"prefix": prefix, "present": present})
    lease_s = lease_field(body)
    store = store_of(request)
    r, lease = await store.lookup_locked(tenant, keys, lease_s, tpb)
    if lease is not None and WRITER in request.app:  # a reader: the writer, which evicts and expires, locks them too
        locked = await share_lease(request.app, lease, lease_s)
        if locked is not None and len(locked) < len(lease.blocks):  # some went on the writer before its pin
            r, lease = r.only(keys, locked), await store.narrow_lock(lease, locked, lease_s)
    # A dead node's blocks this node took over are reported too: nothing evicts or expires them
    # (its store here is read-only) until the node is back, when they are its own again.
    present = with_adopted(request.app, tenant, list(keys), r.present)
    prefix = next((i for i, p in enumerate(present) if not p), len(present))
    lease_id = lease.id if lease else None
    if lease_id is None and any(present):  # only adopted blocks: a lease that holds nothing here (released as any)
        lease_id = uuid.uuid4().hex
    doc = {"prefix": prefix, "present": present, "lease": lease_id, "expires_in_s": lease_s}
    return web.json_response(doc)


MAX_LIST = 10_000


@routes.get("/v1/keys", allow_head=False)
async def list_keys(request: web.Request) -> web.Response:
    """A page of the tenant's keys (``prefix``, ``start_after``, ``limit``)."""
    tenant = tenant_of(request)
    q = request.query
    unknown = set(q) - {"prefix", "start_after", "limit"}
    if unknown:
        raise InvalidInput(f"unknown query parameter(s): {', '.join(sorted(unknown))[:200]}")
    prefix = query_value(request, "prefix") or ""
    if prefix:
        try:
            validate_key(prefix)
        except InvalidInput:
            raise InvalidInput(f"query parameter 'prefix' must be up to 256 key characters; got {prefix!r}") from None
    start_after = query_value(request, "start_after")
    if start_after is not None:
        try:
            validate_key(start_after)
        except InvalidInput:
            raise InvalidInput(f"query parameter 'start_after' must be a key; got {start_after!r}") from None
    limit = query_int(request, "limit", 1, MAX_LIST)
    page = 1000 if limit is None else limit
    items, nxt = await store_of(request).list_keys(tenant, prefix, start_after, page)
    keys = [{"key": k, "size": n} for k, n in items]
    return web.json_response({"keys": keys, "next_start_after": nxt})


@routes.get("/v1/stats")
async def stats(request: web.Request) -> web.Response:
    tenant = tenant_of(request)
    store = store_of(request)
    s = await store.stats(tenant)
    return web.json_response(
        {
            "tenant": tenant,
            "blocks": s.blocks,
            "bytes_stored": s.stored_bytes,
            "bytes_logical": s.logical_bytes,
            "qos": store.qos(tenant).public(),  # its own limits: what its clients plan loads with
        }
    )
