"""S3's multipart uploads: Create, UploadPart (and UploadPartCopy), Complete,
Abort, ListParts, ListMultipartUploads.

A part is stored as blocks when it arrives (as a PutObject's body is);
completing the upload makes the parts it names the object's blocks, in
order, without copying a byte. The ETag is S3's: the MD5 of the parts'
binary MD5s, a dash, and the number of parts.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import secrets
import time
from collections.abc import AsyncIterator

from aiohttp import web

from kvstore.buckets import objects, records
from kvstore.buckets.catalog import Dropped, Extents, ObjectRow, PartRow, Upload
from kvstore.transport.s3.bucket_ops import MAX_KEYS
from kvstore.transport.s3.call import Call, validate_object_key
from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.object_ops import (
    meta_from_headers,
    read_source,
    source_chunks,
    upload_body,
    write_condition,
)
from kvstore.transport.s3.xml import children, document, element, iso_time, parse, text_of

MIN_PART = 5 << 20  # every part but the last, as S3
MAX_PARTS = 10_000
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def _xml(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/xml")


def _part_number(call: Call) -> int:
    text = call.q("partNumber") or ""
    if not text.isdigit() or not 1 <= int(text) <= MAX_PARTS:
        raise S3Error(
            "InvalidArgument",
            "Part number must be an integer between 1 and 10000, inclusive",
            ArgumentName="partNumber",
        )
    return int(text)


async def _upload(call: Call) -> Upload:
    """The upload the request names; its record touched (written again if
    gone), as an object's is when it is read."""
    bucket = await call.bucket()
    upload_id = call.q("uploadId") or ""
    found = await call.catalog.run(call.catalog.upload, upload_id) if upload_id else None
    if found is None or found.bucket != bucket.name or found.key != call.key:
        raise S3Error(
            "NoSuchUpload",
            "The specified upload does not exist. The upload ID may be invalid, or the "
            "upload may have been aborted or completed.",
            UploadId=upload_id[:64],
        )
    upload = found
    await records.keep(
        call.store, call.tenant, upload.record, lambda: records.of_upload(upload, call.open_meta(upload.meta))
    )
    return found


async def create_upload(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    assert call.key is not None
    write_condition(call.request)  # checked for form here; S3 checks the condition itself on Complete
    meta = meta_from_headers(call.request)
    algo = (call.request.headers.get("x-amz-checksum-algorithm") or "").lower()
    if algo:
        meta["algo"] = algo
    upload_id = secrets.token_hex(16)
    record = records.key_of(records.UPLOAD, objects.new_uid())
    upload = Upload(upload_id, bucket.name, call.key, time.time_ns(), call.seal_meta(meta), record)
    await call.put_record(record, records.of_upload(upload, meta))
    try:
        await call.catalog.run(call.catalog.create_upload, upload)
    except BaseException:
        await call.discard(Dropped([], [record]))
        raise
    body = document(
        "InitiateMultipartUploadResult",
        [element("Bucket", bucket.name), element("Key", call.key_text), element("UploadId", upload_id)],
    )
    headers = {"x-amz-checksum-algorithm": algo.upper()} if algo else {}
    resp = _xml(body)
    resp.headers.update(headers)
    return resp


async def upload_part(call: Call) -> web.StreamResponse:
    number = _part_number(call)
    upload = await _upload(call)
    if "x-amz-copy-source" in call.request.headers:
        return await _upload_part_copy(call, upload, number)
    body = upload_body(call)
    made: list[PartRow] = []

    def record(extents: Extents) -> tuple[str, records.Record]:
        etag = f'"{body.md5.hexdigest()}"'
        made.append(PartRow(number, body.received, etag, time.time_ns(), extents, _part_record()))
        return made[0].record, records.of_part(upload.upload_id, made[0])

    await objects.store_blocks(call.store, call.tenant, body.chunks(), call.settings.block_size, body.finish, record)
    await _record_part(call, upload, made[0])
    headers = {"ETag": made[0].etag}
    if body.checksum_algorithm is not None and body.checksum_value is not None:
        headers["x-amz-checksum-" + body.checksum_algorithm] = body.checksum_value
    return web.Response(status=200, headers=headers)


def _part_record() -> str:
    return records.key_of(records.PART, objects.new_uid())


async def _record_part(call: Call, upload: Upload, part: PartRow) -> None:
    """Name the part's stored blocks and record in the catalog."""
    try:
        exists, dropped = await call.catalog.run(call.catalog.put_part, upload.upload_id, part)
    except BaseException:
        await call.discard(Dropped(part.blocks, [part.record]))
        raise
    await call.discard(dropped)
    if not exists:  # aborted or completed while the part was arriving
        raise S3Error("NoSuchUpload", "The specified upload does not exist.", UploadId=upload.upload_id)


async def _upload_part_copy(call: Call, upload: Upload, number: int) -> web.StreamResponse:
    src, _, held = await read_source(call)
    try:
        return await _copy_part(call, upload, number, src)
    finally:
        held.release()


async def _copy_part(call: Call, upload: Upload, number: int, src: ObjectRow) -> web.StreamResponse:
    start, end = 0, src.size
    text = call.request.headers.get("x-amz-copy-source-range")
    if text is not None:
        m = _RANGE.fullmatch(text.strip())
        if m is not None and int(m.group(1)) <= int(m.group(2)) and int(m.group(2)) >= src.size:
            raise S3Error(
                "InvalidRange",
                "The x-amz-copy-source-range value must be of the form bytes=first-last where first and last are "
                "the zero-based offsets of the first and last bytes to copy, within the source object",
                ActualObjectSize=str(src.size),
            )
        if m is None or int(m.group(1)) > int(m.group(2)):
            raise S3Error(
                "InvalidArgument",
                "The x-amz-copy-source-range value must be of the form bytes=first-last "
                "where first and last are the zero-based offsets of the first and last bytes to copy",
            )
        start, end = int(m.group(1)), int(m.group(2)) + 1
    md5 = hashlib.md5(usedforsecurity=False)

    async def hashed() -> AsyncIterator[bytes]:
        async for data in source_chunks(call, src, start, end):
            md5.update(data)
            yield data

    made: list[PartRow] = []

    def record(extents: Extents) -> tuple[str, records.Record]:
        made.append(PartRow(number, end - start, f'"{md5.hexdigest()}"', time.time_ns(), extents, _part_record()))
        return made[0].record, records.of_part(upload.upload_id, made[0])

    await objects.store_blocks(call.store, call.tenant, hashed(), call.settings.block_size, None, record)
    part = made[0]
    await _record_part(call, upload, part)
    return _xml(
        document("CopyPartResult", [element("LastModified", iso_time(part.mtime_ns)), element("ETag", part.etag)])
    )


def _complete_result(call: Call, bucket: str, etag: str) -> web.Response:
    return _xml(
        document(
            "CompleteMultipartUploadResult",
            [
                element("Location", f"http://{call.request.host}/{bucket}/{call.key_text}"),
                element("Bucket", bucket),
                element("Key", call.key_text),
                element("ETag", etag),
            ],
        )
    )


async def complete(call: Call) -> web.StreamResponse:
    done = await call.catalog.run(call.catalog.completed, call.q("uploadId") or "")
    if done is not None and done[0] == call.bucket_name and done[1] == call.key:
        await call.bucket()
        await call.xml_body(checksums=False)
        return _complete_result(call, done[0], done[2])  # completed already: the same answer, as S3 gives
    upload = await _upload(call)
    # Its x-amz-checksum-* headers are the whole object's (S3's full-object
    # checksum), not its XML document's: not checked here (see docs/API.md).
    doc = parse(await call.xml_body(checksums=False), "CompleteMultipartUpload")
    asked: list[tuple[int, str]] = []
    for item in children(doc, "Part"):
        number_text, etag_text = text_of(item, "PartNumber"), text_of(item, "ETag")
        if number_text is None or etag_text is None or not number_text.strip().isdigit():
            raise S3Error("MalformedXML", "each <Part> needs a <PartNumber> and an <ETag>")
        asked.append((int(number_text), etag_text.strip()))
    if not asked:
        raise S3Error("MalformedXML", "You must specify at least one part")
    if any(b[0] <= a[0] for a, b in itertools.pairwise(asked)):
        raise S3Error(
            "InvalidPartOrder",
            "The list of parts was not in ascending order. The parts list must be specified in order by part number.",
        )
    stored = {p.part: p for p in await call.catalog.run(call.catalog.parts, upload.upload_id)}
    chosen: list[PartRow] = []
    for number, etag in asked:
        part = stored.get(number)
        if part is None or part.etag.strip('"') != etag.strip('"'):
            raise S3Error(
                "InvalidPart",
                "One or more of the specified parts could not be found. The part may not "
                "have been uploaded, or the specified entity tag may not match the part's entity tag.",
                PartNumber=str(number),
                ETag=etag[:80],
            )
        chosen.append(part)
    for part in chosen[:-1]:
        if part.size < MIN_PART:
            raise S3Error(
                "EntityTooSmall",
                "Your proposed upload is smaller than the minimum allowed object size.",
                PartNumber=str(part.part),
                ProposedSize=str(part.size),
                MinSizeAllowed=str(MIN_PART),
            )
    digest = hashlib.md5(b"".join(bytes.fromhex(p.etag.strip('"')) for p in chosen), usedforsecurity=False)
    etag = f'"{digest.hexdigest()}-{len(chosen)}"'
    meta = call.open_meta(upload.meta)
    meta["parts"] = [p.size for p in chosen]
    meta.pop("algo", None)
    blocks = [b for p in chosen for b in p.blocks]
    record = records.key_of(records.OBJECT, objects.new_uid())
    row = ObjectRow(upload.key, sum(p.size for p in chosen), etag, time.time_ns(), call.seal_meta(meta), blocks, record)
    if not await objects.blocks_present(call.store, call.tenant, blocks):
        raise S3Error("InvalidPart", "a part's stored blocks are gone (evicted or expired); upload it again")
    await call.put_record(record, records.of_object(upload.bucket, row, meta))
    try:
        dropped = await call.catalog.run(
            call.catalog.complete, upload, row, {p.part for p in chosen}, write_condition(call.request)
        )
    except BaseException:
        await call.discard(Dropped([], [record]))  # the parts' blocks stay the upload's
        raise
    await call.discard(dropped)
    return _complete_result(call, upload.bucket, etag)


async def abort(call: Call) -> web.StreamResponse:
    upload = await _upload(call)
    _, dropped = await call.catalog.run(call.catalog.abort, upload.upload_id)
    await call.discard(dropped)
    return web.Response(status=204)


async def list_parts(call: Call) -> web.StreamResponse:
    upload = await _upload(call)
    marker_text = call.q("part-number-marker") or "0"
    max_text = call.q("max-parts") or "1000"
    if not marker_text.isdigit() or not max_text.isdigit():
        raise S3Error("InvalidArgument", "part-number-marker and max-parts must be integers")
    marker, max_parts = int(marker_text), min(int(max_text), 1000)
    parts = await call.catalog.run(call.catalog.parts, upload.upload_id, marker, max_parts + 1)
    truncated = len(parts) > max_parts
    parts = parts[:max_parts]
    items = [
        "<Part>"
        + element("PartNumber", p.part)
        + element("LastModified", iso_time(p.mtime_ns))
        + element("ETag", p.etag)
        + element("Size", p.size)
        + "</Part>"
        for p in parts
    ]
    body = document(
        "ListPartsResult",
        [
            element("Bucket", upload.bucket),
            element("Key", call.key_text),
            element("UploadId", upload.upload_id),
            element("PartNumberMarker", marker),
            element("NextPartNumberMarker", parts[-1].part if parts else marker),
            element("MaxParts", max_parts),
            element("IsTruncated", truncated),
            element("StorageClass", "STANDARD"),
            *items,
        ],
    )
    return _xml(body)


async def list_uploads(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    prefix = validate_object_key(call.q("prefix") or "")
    key_marker = call.q("key-marker")
    id_marker = call.q("upload-id-marker") or ""
    max_text = call.q("max-uploads") or str(MAX_KEYS)
    if not max_text.isdigit():
        raise S3Error("InvalidArgument", "max-uploads must be an integer", ArgumentName="max-uploads")
    limit = min(int(max_text), MAX_KEYS)
    after = (validate_object_key(key_marker), id_marker if id_marker else "\uffff") if key_marker else None
    if key_marker and id_marker:
        after = (validate_object_key(key_marker), id_marker)
    uploads = await call.catalog.run(call.catalog.uploads, bucket.name, prefix, after, limit + 1)
    truncated = len(uploads) > limit
    uploads = uploads[:limit]
    items = [
        "<Upload>"
        + element("Key", u.key.decode())
        + element("UploadId", u.upload_id)
        + element("Initiated", iso_time(u.created_ns))
        + element("StorageClass", "STANDARD")
        + "</Upload>"
        for u in uploads
    ]
    body = [
        element("Bucket", bucket.name),
        element("KeyMarker", key_marker or ""),
        element("UploadIdMarker", id_marker),
        element("Prefix", prefix.decode()),
        element("MaxUploads", limit),
        element("IsTruncated", truncated),
    ]
    if truncated and uploads:
        body += [
            element("NextKeyMarker", uploads[-1].key.decode()),
            element("NextUploadIdMarker", uploads[-1].upload_id),
        ]
    return _xml(document("ListMultipartUploadsResult", body + items))
