"""S3's object operations: PutObject, GetObject, HeadObject, DeleteObject, CopyObject."""

from __future__ import annotations

import dataclasses
import email.utils
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from kvstore.buckets import objects, records
from kvstore.buckets.catalog import Dropped, Extents, ObjectRow
from kvstore.buckets.objects import Held
from kvstore.engine.api import DirectExtent
from kvstore.errors import InvalidRange, KVStoreError, NotFound
from kvstore.transport.http.appkeys import config_of
from kvstore.transport.http.qos import ticket_of
from kvstore.transport.http.ranges import parse_range
from kvstore.transport.http.respond import send
from kvstore.transport.http.sendfile import send_extent
from kvstore.transport.s3.body import UploadBody
from kvstore.transport.s3.call import Call, validate_bucket_name, validate_object_key
from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.sigv4 import STREAMING_SIGNED, STREAMING_SIGNED_TRAILER, ChunkSigner
from kvstore.transport.s3.xml import document, element, http_time, iso_time

# Headers stored with an object and sent back with it.
STORED_HEADERS = ("Content-Type", "Content-Disposition", "Content-Language", "Cache-Control", "Expires")
DEFAULT_CONTENT_TYPE = "binary/octet-stream"
_OVERRIDES = {
    "response-content-type": "Content-Type",
    "response-content-language": "Content-Language",
    "response-expires": "Expires",
    "response-cache-control": "Cache-Control",
    "response-content-disposition": "Content-Disposition",
    "response-content-encoding": "Content-Encoding",
}


def meta_from_headers(request: web.Request) -> dict[str, Any]:
    """What an upload's headers say about the object, as it is stored."""
    headers: dict[str, str] = {}
    for name in STORED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    encoding = [
        c.strip()
        for c in (request.headers.get("Content-Encoding") or "").split(",")
        if c.strip() and c.strip() != "aws-chunked"
    ]
    if encoding:
        headers["Content-Encoding"] = ", ".join(encoding)
    user = {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-amz-meta-")}
    if sum(len(k) + len(v) for k, v in user.items()) > 2048:
        raise S3Error("InvalidArgument", "Your metadata headers exceed the maximum allowed metadata size (2 KB)")
    return {"h": headers, "m": user}


def signer_of(call: Call) -> ChunkSigner | None:
    if call.auth.payload_hash in (STREAMING_SIGNED, STREAMING_SIGNED_TRAILER):
        return ChunkSigner(call.signing_key, call.auth)
    return None


def upload_body(call: Call) -> UploadBody:
    return UploadBody(
        call.request.content, call.request.headers, call.auth.payload_hash, signer_of(call), call.settings.max_object
    )


def _parse_http_date(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return parsed.timestamp()


def _etag_list(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def _etag_in(value: str, etag: str) -> bool:
    tags = _etag_list(value)
    bare = etag.strip('"')
    return any(t == "*" or t.removeprefix("W/").strip('"') == bare for t in tags)


def check_read_conditions(request: web.Request, obj: ObjectRow) -> int | None:
    """The status a GET/HEAD's conditions call for (412, 304), or None to
    answer (S3's rules, "Conditional requests": If-Match wins over
    If-Unmodified-Since, If-None-Match over If-Modified-Since)."""
    mtime = obj.mtime_ns // 1_000_000_000
    if_match = request.headers.get("If-Match")
    if_none = request.headers.get("If-None-Match")
    unmodified = _parse_http_date(request.headers.get("If-Unmodified-Since"))
    modified = _parse_http_date(request.headers.get("If-Modified-Since"))
    if if_match is not None:
        if not _etag_in(if_match, obj.etag):
            return 412
    elif unmodified is not None and mtime > unmodified:
        return 412
    if if_none is not None:
        if _etag_in(if_none, obj.etag):
            return 304
    elif modified is not None and mtime <= modified:
        return 304
    return None


def write_condition(request: web.Request) -> Any:
    """The check a conditional write makes on the object it would replace,
    inside the catalog's transaction: ``If-None-Match`` (``*``: no object;
    entity tags: not one of them), ``If-Match`` (``*``: an object; entity
    tags: one of them; no object: NoSuchKey)."""
    if_none = request.headers.get("If-None-Match")
    if_match = request.headers.get("If-Match")
    if if_none is None and if_match is None:
        return None

    def expect(old: ObjectRow | None) -> None:
        if if_none is not None and old is not None and _etag_in(if_none, old.etag):
            raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
        if if_match is not None:
            if old is None:
                raise S3Error("NoSuchKey", "The specified key does not exist.")
            if not _etag_in(if_match, old.etag):
                raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")

    return expect


async def put_object(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    assert call.key is not None
    expect = write_condition(call.request)
    meta = meta_from_headers(call.request)
    body = upload_body(call)
    made: list[ObjectRow] = []

    def record(extents: Extents) -> tuple[str, records.Record]:  # the body has ended and passed its checks
        if body.checksum_algorithm is not None:
            meta["ck"] = [body.checksum_algorithm, body.checksum_value]
        etag = f'"{body.md5.hexdigest()}"'
        key = records.key_of(records.OBJECT, objects.new_uid())
        made.append(ObjectRow(call.key or b"", body.received, etag, time.time_ns(), call.seal_meta(meta), extents, key))
        return key, records.of_object(bucket.name, made[0], meta)

    await objects.store_blocks(call.store, call.tenant, body.chunks(), call.settings.block_size, body.finish, record)
    row = made[0]
    await _commit(call, bucket.name, row, expect)
    headers = {"ETag": row.etag}
    if body.checksum_algorithm is not None and body.checksum_value is not None:
        headers["x-amz-checksum-" + body.checksum_algorithm] = body.checksum_value
    return web.Response(status=200, headers=headers)


async def _commit(call: Call, bucket: str, row: ObjectRow, expect: Any) -> None:
    """Name the stored blocks and their record in the catalog (replacing
    the object's old blocks and record, deleted after); if the catalog
    refuses, delete the new ones."""
    try:
        old = await call.catalog.run(call.catalog.put, bucket, row, expect)
    except BaseException:
        await call.discard(Dropped(row.blocks, [row.record]))
        raise
    await call.discard(old)


async def _object(call: Call) -> tuple[ObjectRow, dict[str, Any], Held]:
    """The object the request names, its metadata, and its blocks held for
    this read (the caller releases them once the answer is sent). Its
    record is touched (written again if gone), as its bucket's is by any
    request: it lasts as long as the object's bytes under the quota's LRU
    and the TTL."""
    bucket = await call.bucket()
    assert call.key is not None
    obj = call.catalog.get_now(bucket.name, call.key)
    if obj is None:
        raise S3Error("NoSuchKey", "The specified key does not exist.", Key=call.key_text)
    held = call.readers.hold(obj.blocks)  # before anything else awaits: a replacement now waits for us
    try:
        if not await objects.blocks_present(call.store, call.tenant, obj.blocks):
            # A block was evicted (quota, disk), expired (TTL) or deleted: the object is gone.
            await call.discard(await call.catalog.run(call.catalog.delete, bucket.name, call.key, obj.blocks))
            raise S3Error("NoSuchKey", "The specified key does not exist.", Key=call.key_text)
        meta = call.open_meta(obj.meta)
        await records.keep(call.store, call.tenant, obj.record, lambda: records.of_object(bucket.name, obj, meta))
        return obj, meta, held
    except BaseException:
        held.release()
        raise


def _object_headers(call: Call, obj: ObjectRow, meta: dict[str, Any]) -> dict[str, str]:
    headers: dict[str, str] = {
        "ETag": obj.etag,
        "Last-Modified": http_time(obj.mtime_ns),
        "Accept-Ranges": "bytes",
        "Content-Type": DEFAULT_CONTENT_TYPE,
    }
    headers.update(meta.get("h", {}))
    headers.update(meta.get("m", {}))
    parts = meta.get("parts")
    if parts and call.q("partNumber") is not None:
        headers["x-amz-mp-parts-count"] = str(len(parts))
    ck = meta.get("ck")
    if ck and (call.request.headers.get("x-amz-checksum-mode") or "").upper() == "ENABLED":
        headers["x-amz-checksum-" + ck[0]] = ck[1]
    for param, header in _OVERRIDES.items():
        value = call.q(param)
        if value is not None:
            headers[header] = value
    return headers


def _part_span(call: Call, obj: ObjectRow, meta: dict[str, Any]) -> tuple[int, int] | None:
    text = call.q("partNumber")
    if text is None:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 10_000:
        raise S3Error("InvalidArgument", "Part number must be an integer between 1 and 10000, inclusive")
    sizes = meta.get("parts") or [obj.size]
    n = int(text)
    if n > len(sizes):
        raise S3Error("InvalidPartNumber", "The requested partnumber is not satisfiable")
    start = sum(sizes[: n - 1])
    return start, start + sizes[n - 1]


async def get_object(call: Call, head: bool = False) -> web.StreamResponse:
    obj, meta, held = await _object(call)
    try:
        return await _answer(call, obj, meta, head)
    finally:
        held.release()


async def _answer(call: Call, obj: ObjectRow, meta: dict[str, Any], head: bool) -> web.StreamResponse:
    headers = _object_headers(call, obj, meta)
    status = check_read_conditions(call.request, obj)
    if status == 412:
        raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
    if status == 304:
        return web.Response(status=304, headers={k: headers[k] for k in ("ETag", "Last-Modified")})
    start, end = 0, obj.size
    code = 200
    span = _part_span(call, obj, meta)
    if span is not None:
        start, end = span
        code = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{obj.size}"
    elif call.request.headers.get("Range") is not None:
        try:
            ranges = parse_range(call.request.headers["Range"], obj.size)
        except InvalidRange:
            raise S3Error(
                "InvalidRange", "The requested range is not satisfiable", ActualObjectSize=str(obj.size)
            ) from None
        if ranges is not None and len(ranges) == 1:  # S3 serves one range; several: the whole object
            start, end = ranges[0].start, ranges[0].end
            code = 206
            headers["Content-Range"] = ranges[0].content_range(obj.size)
    if code == 206:  # the stored checksum is the whole object's: S3 sends none with a part of it
        for name in [h for h in headers if h.lower().startswith("x-amz-checksum-")]:
            del headers[name]
    headers["Content-Length"] = str(end - start)
    if head:
        return web.Response(status=code, headers=headers)
    ticket = ticket_of(call.request)  # the bytes from the tenant's read limit, before they are read
    await ticket.reserve("read", end - start)
    ticket.served("read", end - start)
    resp = web.StreamResponse(status=code, headers=headers)
    resp.content_length = end - start
    chunks = objects.read_range(call.store, call.tenant, obj.blocks, start, end)
    first: objects.Piece | None = None
    try:
        if end > start:
            first = await anext(chunks)  # a block gone since the check above is still a 404
    except (NotFound, StopAsyncIteration):
        await chunks.aclose()
        raise S3Error("NoSuchKey", "The specified key does not exist.", Key=call.key_text) from None
    try:
        await resp.prepare(call.request)
        if first is not None:
            await _send_piece(call, resp, first)
            first = None
            async for piece in chunks:
                await _send_piece(call, resp, piece)
    except KVStoreError as e:
        # Part of the answer is out: only a cut connection can tell the client.
        raise ConnectionResetError(f"the object's block became unreadable mid-answer: {e.code}") from None
    finally:
        if first is not None:
            objects.release(first)
        await chunks.aclose()
    await resp.write_eof()
    return resp


async def _send_piece(call: Call, resp: web.StreamResponse, piece: objects.Piece) -> None:
    """Send one block's bytes: a direct block's straight from its segment
    file (sendfile, as GET /v1/blocks does), others from memory."""
    try:
        if isinstance(piece, DirectExtent):
            await send_extent(call.request, resp, piece, config_of(call.request).sendfile)
        else:
            await send(call.request, resp, piece)
    finally:
        objects.release(piece)


async def delete_object(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    assert call.key is not None
    await call.discard(await call.catalog.run(call.catalog.delete, bucket.name, call.key, None))
    return web.Response(status=204)


def copy_source(call: Call) -> tuple[str, bytes]:
    raw = call.request.headers["x-amz-copy-source"]
    text = unquote(raw.partition("?")[0]).lstrip("/")
    name, sep, key = text.partition("/")
    if not sep or not key:
        raise S3Error("InvalidArgument", "Copy Source must mention the source bucket and key: sourcebucket/sourcekey")
    if "versionId=" in raw:
        raise S3Error("NotImplemented", "this gateway keeps no versions: x-amz-copy-source cannot name a versionId")
    return validate_bucket_name(name), validate_object_key(key)


async def read_source(call: Call) -> tuple[ObjectRow, dict[str, Any], Held]:
    """The object x-amz-copy-source names, readable by the caller, its
    blocks held until the caller releases them."""
    name, key = copy_source(call)
    source = dataclasses.replace(call, bucket_name=name, key=key, query={})
    obj, meta, held = await _object(source)
    if _copy_conditions(call, obj) is not None:
        held.release()
        raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold")
    return obj, meta, held


def _copy_conditions(call: Call, obj: ObjectRow) -> int | None:
    h = call.request.headers
    mtime = obj.mtime_ns // 1_000_000_000
    match = h.get("x-amz-copy-source-if-match")
    none = h.get("x-amz-copy-source-if-none-match")
    unmod = _parse_http_date(h.get("x-amz-copy-source-if-unmodified-since"))
    mod = _parse_http_date(h.get("x-amz-copy-source-if-modified-since"))
    if match is not None and not _etag_in(match, obj.etag):
        return 412
    if match is None and unmod is not None and mtime > unmod:
        return 412
    if none is not None and _etag_in(none, obj.etag):
        return 412
    if none is None and mod is not None and mtime <= mod:
        return 412
    return None


async def source_chunks(call: Call, obj: ObjectRow, start: int, end: int) -> AsyncIterator[bytes]:
    async for piece in objects.read_range(call.store, call.tenant, obj.blocks, start, end):
        try:
            yield bytes(piece.view if isinstance(piece, DirectExtent) else piece)
        finally:
            objects.release(piece)


async def copy_object(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    assert call.key is not None
    src, src_meta, held = await read_source(call)
    try:
        return await _copy(call, bucket.name, src, src_meta)
    finally:
        held.release()


async def _copy(call: Call, bucket: str, src: ObjectRow, src_meta: dict[str, Any]) -> web.StreamResponse:
    assert call.key is not None
    directive = (call.request.headers.get("x-amz-metadata-directive") or "COPY").upper()
    if directive not in ("COPY", "REPLACE"):
        raise S3Error("InvalidArgument", "Unknown metadata directive.")
    name, key = copy_source(call)
    if name == bucket and key == call.key and directive == "COPY":
        raise S3Error(
            "InvalidRequest",
            "This copy request is illegal because it is trying to copy an object to itself without changing the "
            "object's metadata, storage class, website redirect location or encryption attributes.",
        )
    meta = meta_from_headers(call.request) if directive == "REPLACE" else dict(src_meta)
    meta.pop("parts", None)
    expect = write_condition(call.request)
    md5 = hashlib.md5(usedforsecurity=False)

    async def hashed() -> AsyncIterator[bytes]:
        async for data in source_chunks(call, src, 0, src.size):
            md5.update(data)
            yield data

    made: list[ObjectRow] = []

    def record(extents: Extents) -> tuple[str, records.Record]:
        key = records.key_of(records.OBJECT, objects.new_uid())
        etag = f'"{md5.hexdigest()}"'
        made.append(ObjectRow(call.key or b"", src.size, etag, time.time_ns(), call.seal_meta(meta), extents, key))
        return key, records.of_object(bucket, made[0], meta)

    await objects.store_blocks(call.store, call.tenant, hashed(), call.settings.block_size, None, record)
    row = made[0]
    await _commit(call, bucket, row, expect)
    body = document("CopyObjectResult", [element("LastModified", iso_time(row.mtime_ns)), element("ETag", row.etag)])
    return web.Response(body=body, content_type="application/xml")
