"""S3's bucket operations: ListBuckets, Create/Head/DeleteBucket, ListObjects
(V1 and V2), DeleteObjects, GetBucketLocation, GetBucketVersioning."""

from __future__ import annotations

import base64
import binascii
import time
from urllib.parse import quote

from aiohttp import web

from kvstore.buckets import records
from kvstore.buckets.catalog import Bucket, Dropped, ObjectRow
from kvstore.buckets.objects import new_uid
from kvstore.transport.s3.call import Call, validate_bucket_name, validate_object_key
from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.xml import children, document, element, iso_time, parse, text_of

MAX_KEYS = 1000
MAX_DELETE = 1000


def _xml(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/xml")


def _owner(call: Call) -> str:
    return "<Owner>" + element("ID", call.tenant) + element("DisplayName", call.tenant) + "</Owner>"


async def list_buckets(call: Call) -> web.StreamResponse:
    """ListBuckets: the caller's buckets by name, paged with ``max-buckets``
    (1 to 10,000) and ``continuation-token``, filtered by ``prefix``."""
    prefix = call.q("prefix") or ""
    max_text = call.q("max-buckets")
    if max_text is not None and (not max_text.isdigit() or not 1 <= int(max_text) <= 10_000):
        raise S3Error("InvalidArgument", "max-buckets must be an integer from 1 to 10000", ArgumentName="max-buckets")
    token = call.q("continuation-token")
    after = _from_token(token).decode("utf-8", "replace") if token else ""
    buckets = [
        b
        for b in await call.catalog.run(call.catalog.buckets, call.tenant)
        if b.incarnation == call.incarnation and b.name.startswith(prefix) and b.name > after
    ]
    limit = int(max_text) if max_text is not None else len(buckets)
    page, more = buckets[:limit], len(buckets) > limit
    items = "".join(
        "<Bucket>"
        + element("Name", b.name)
        + element("CreationDate", iso_time(b.created_ns))
        + element("BucketRegion", b.region)
        + "</Bucket>"
        for b in page
    )
    body = [_owner(call), "<Buckets>", items, "</Buckets>", element("Prefix", prefix if prefix else None)]
    if more:
        body.append(element("ContinuationToken", _token(page[-1].name.encode())))
    return _xml(document("ListAllMyBucketsResult", body))


async def create_bucket(call: Call) -> web.StreamResponse:
    assert call.bucket_name is not None
    name = validate_bucket_name(call.bucket_name)
    body = await call.xml_body()
    if body.strip():
        doc = parse(body, "CreateBucketConfiguration")
        constraint = text_of(doc, "LocationConstraint")
        if constraint and constraint != call.settings.region:
            raise S3Error(
                "IllegalLocationConstraintException",
                f"The {constraint[:64]} location constraint is incompatible for the region specific endpoint this "
                f"request was sent to ({call.settings.region}).",
            )
    found = await call.catalog.run(call.catalog.bucket, name)
    if found is not None and call.store.incarnation(found.tenant) != found.incarnation:
        await call.catalog.run(call.catalog.forget_bucket, name)
        found = None
    if found is None:  # its record first, then the row that names it
        record = records.key_of(records.BUCKET, new_uid())
        bucket = Bucket(name, call.tenant, call.incarnation, time.time_ns(), call.settings.region, record)
        await call.put_record(record, records.of_bucket(bucket))
        try:
            found = await call.catalog.run(call.catalog.create_bucket, bucket)
        except BaseException:
            await call.discard(Dropped([], [record]))
            raise
        if found is not None:  # created by another request meanwhile
            await call.discard(Dropped([], [record]))
    if found is not None:
        if found.tenant == call.tenant and found.incarnation == call.incarnation:
            if call.settings.region == "us-east-1":  # S3's legacy region answers success and changes nothing
                return web.Response(status=200, headers={"Location": "/" + name})
            raise S3Error(
                "BucketAlreadyOwnedByYou",
                "Your previous request to create the named bucket succeeded and you already own it.",
                BucketName=name,
            )
        raise S3Error(
            "BucketAlreadyExists",
            "The requested bucket name is not available. The bucket namespace is shared by all users of the system.",
            BucketName=name,
        )
    return web.Response(status=200, headers={"Location": "/" + name})


async def head_bucket(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    return web.Response(status=200, headers={"x-amz-bucket-region": bucket.region})


async def delete_bucket(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    deleted, dropped = await call.catalog.run(call.catalog.delete_bucket, bucket.name, True)
    if not deleted:
        raise S3Error("BucketNotEmpty", "The bucket you tried to delete is not empty", BucketName=bucket.name)
    await call.discard(dropped)  # its record, its unfinished uploads' and their parts'
    return web.Response(status=204)


async def get_location(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    region = "" if bucket.region == "us-east-1" else bucket.region  # S3 answers us-east-1 as empty
    return _xml(document("LocationConstraint", [region]))


async def put_versioning(call: Call) -> web.StreamResponse:
    """Versioning cannot be enabled here: ``Suspended`` (what an unversioned
    bucket behaves as) is accepted, ``Enabled`` is NotImplemented."""
    await call.bucket()
    doc = parse(await call.xml_body(), "VersioningConfiguration")
    status = (text_of(doc, "Status") or "").strip()
    if status == "Enabled":
        raise S3Error("NotImplemented", "this gateway keeps no object versions: versioning cannot be enabled")
    if status not in ("", "Suspended"):
        raise S3Error("MalformedXML", "Status must be Enabled or Suspended")
    return web.Response(status=200)


async def get_versioning(call: Call) -> web.StreamResponse:
    await call.bucket()
    return _xml(document("VersioningConfiguration", []))


def _max_keys(call: Call) -> int:
    text = call.q("max-keys")
    if text is None:
        return MAX_KEYS
    if not text.isdigit() or len(text) > 10:
        raise S3Error(
            "InvalidArgument", "Provided max-keys not an integer or within integer range", ArgumentName="max-keys"
        )
    return min(int(text), MAX_KEYS)


def _encoding(call: Call) -> bool:
    value = call.q("encoding-type")
    if value is None:
        return False
    if value.lower() != "url":
        raise S3Error("InvalidArgument", "Invalid Encoding Method specified in Request", ArgumentName="encoding-type")
    return True


def _token(after: bytes) -> str:
    return base64.urlsafe_b64encode(after).decode()


def _from_token(token: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(token.encode())
    except (binascii.Error, ValueError):
        raise S3Error(
            "InvalidArgument", "The continuation token provided is incorrect", ArgumentName="continuation-token"
        ) from None


class _Page:
    """One page of a listing: objects and common prefixes, S3's rules."""

    def __init__(self) -> None:
        self.contents: list[ObjectRow] = []
        self.prefixes: list[bytes] = []
        self.truncated = False
        self.last: bytes | None = None  # where the next page starts (exclusive)


async def _list(call: Call, bucket: str, prefix: bytes, delimiter: bytes, after: bytes | None, max_keys: int) -> _Page:
    page = _Page()
    if max_keys == 0:
        return page
    if (
        delimiter
        and after is not None
        and after.startswith(prefix)
        and after.find(delimiter, len(prefix)) == len(after) - len(delimiter)
    ):
        after += b"\xff"  # a marker naming a common prefix: start past every key under it
    cursor = after
    while True:
        rows = await call.catalog.run(call.catalog.list_objects, bucket, cursor, prefix, max(64, max_keys * 2))
        if not rows:
            return page
        live = await _live(call, bucket, rows)
        for row in rows:
            cursor = row.key
            if row.key not in live:
                continue
            if delimiter:
                cut = row.key.find(delimiter, len(prefix))
                if cut >= 0:
                    common = row.key[: cut + len(delimiter)]
                    if len(page.contents) + len(page.prefixes) == max_keys:
                        page.truncated = True
                        return page
                    page.prefixes.append(common)
                    page.last = cursor = common + b"\xff"  # past every key under it: 0xff is never in UTF-8
                    break
            if len(page.contents) + len(page.prefixes) == max_keys:
                page.truncated = True
                return page
            page.contents.append(row)
            page.last = row.key


async def _live(call: Call, bucket: str, rows: list[ObjectRow]) -> set[bytes]:
    """The keys of ``rows`` whose blocks are all still stored; objects that
    lost a block (evicted, expired, deleted over /v1) leave the catalog."""
    keys = [k for row in rows for k, _ in row.blocks]
    present = dict(zip(keys, await call.store.present(call.tenant, keys), strict=True)) if keys else {}
    live = set()
    for row in rows:
        if all(present.get(k, False) for k, _ in row.blocks):
            live.add(row.key)
        else:
            await call.discard(await call.catalog.run(call.catalog.delete, bucket, row.key, row.blocks))
    return live


def _enc(value: bytes | str, url: bool) -> str:
    text = value.decode() if isinstance(value, bytes) else value
    return quote(text, safe="/") if url else text


def _contents(call: Call, page: _Page, url: bool, owner: bool) -> list[str]:
    out = []
    for row in page.contents:
        out.append(
            "<Contents>"
            + element("Key", _enc(row.key, url))
            + element("LastModified", iso_time(row.mtime_ns))
            + element("ETag", row.etag)
            + element("Size", row.size)
            + element("StorageClass", "STANDARD")
            + (_owner(call) if owner else "")
            + "</Contents>"
        )
    for p in page.prefixes:
        out.append("<CommonPrefixes>" + element("Prefix", _enc(p, url)) + "</CommonPrefixes>")
    return out


async def list_objects(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    v2 = call.q("list-type") == "2"
    if call.q("list-type") not in (None, "2"):
        raise S3Error("InvalidArgument", "Invalid list-type; expected 2", ArgumentName="list-type")
    url = _encoding(call)
    prefix = validate_object_key(call.q("prefix") or "")
    delimiter = (call.q("delimiter") or "").encode()
    max_keys = _max_keys(call)
    token = call.q("continuation-token")
    start_after = call.q("start-after") if v2 else call.q("marker")
    after: bytes | None = None
    if v2 and token is not None:
        after = _from_token(token)
    elif start_after:
        after = validate_object_key(start_after)
    page = await _list(call, bucket.name, prefix, delimiter, after, max_keys)
    body = [
        element("Name", bucket.name),
        element("Prefix", _enc(prefix, url and v2)),  # V1 answers its Prefix as given: clients decode it only in V2
        element("Delimiter", _enc(delimiter, url) if delimiter else None),
        element("MaxKeys", max_keys),
        element("EncodingType", "url" if url else None),
        element("IsTruncated", page.truncated),
    ]
    if v2:
        body += [
            element("KeyCount", len(page.contents) + len(page.prefixes)),
            element("ContinuationToken", token),
            element("StartAfter", _enc(start_after, url) if start_after else None),
        ]
        if page.truncated and page.last is not None:
            body.append(element("NextContinuationToken", _token(page.last)))
    else:
        body.append(element("Marker", _enc(start_after or "", url)))
        if page.truncated and delimiter and page.last is not None:
            last = page.last.removesuffix(b"\xff")
            body.append(element("NextMarker", _enc(last, url)))
    fetch_owner = call.q("fetch-owner") == "true" or not v2
    body += _contents(call, page, url, fetch_owner)
    return _xml(document("ListBucketResult", body))


async def delete_objects(call: Call) -> web.StreamResponse:
    bucket = await call.bucket()
    has_digest = any(
        h in call.request.headers
        for h in (
            "Content-MD5",
            "x-amz-checksum-crc32",
            "x-amz-checksum-crc32c",
            "x-amz-checksum-sha1",
            "x-amz-checksum-sha256",
            "x-amz-checksum-crc64nvme",
            "x-amz-sdk-checksum-algorithm",
        )
    )
    if not has_digest:
        raise S3Error("InvalidRequest", "Missing required header for this request: Content-MD5")
    raw = await call.xml_body()
    doc = parse(raw, "Delete")
    quiet = (text_of(doc, "Quiet") or "").strip().lower() == "true"
    items = children(doc, "Object")
    if len(items) > MAX_DELETE:
        raise S3Error("MalformedXML", f"a DeleteObjects request names at most {MAX_DELETE} objects")
    out: list[str] = []
    for item in items:
        key_text = text_of(item, "Key")
        if key_text is None:
            raise S3Error("MalformedXML", "an <Object> of the <Delete> document has no <Key>")
        try:
            key = validate_object_key(key_text)
        except S3Error as e:
            out.append(
                "<Error>"
                + element("Key", key_text[:1024])
                + element("Code", e.s3_code)
                + element("Message", e.message)
                + "</Error>"
            )
            continue
        await call.discard(await call.catalog.run(call.catalog.delete, bucket.name, key, None))
        if not quiet:
            out.append("<Deleted>" + element("Key", key_text) + "</Deleted>")
    return _xml(document("DeleteResult", out))


async def list_object_versions(call: Call) -> web.StreamResponse:
    """ListObjectVersions of a bucket without versioning (every bucket here):
    each object is its one version, ``null``, the latest, as S3 lists an
    unversioned bucket's objects."""
    bucket = await call.bucket()
    url = _encoding(call)
    prefix = validate_object_key(call.q("prefix") or "")
    delimiter = (call.q("delimiter") or "").encode()
    max_keys = _max_keys(call)
    key_marker = call.q("key-marker") or ""
    version_marker = call.q("version-id-marker") or ""
    after = validate_object_key(key_marker) if key_marker else None
    page = await _list(call, bucket.name, prefix, delimiter, after, max_keys)
    body = [
        element("Name", bucket.name),
        element("Prefix", _enc(prefix, url)),
        element("KeyMarker", _enc(key_marker, url)),
        element("VersionIdMarker", version_marker),
        element("Delimiter", _enc(delimiter, url) if delimiter else None),
        element("MaxKeys", max_keys),
        element("EncodingType", "url" if url else None),
        element("IsTruncated", page.truncated),
    ]
    if page.truncated and page.last is not None:
        body += [
            element("NextKeyMarker", _enc(page.last.removesuffix(b"\xff"), url)),
            element("NextVersionIdMarker", "null"),
        ]
    for row in page.contents:
        body.append(
            "<Version>"
            + element("Key", _enc(row.key, url))
            + element("VersionId", "null")
            + element("IsLatest", True)
            + element("LastModified", iso_time(row.mtime_ns))
            + element("ETag", row.etag)
            + element("Size", row.size)
            + element("StorageClass", "STANDARD")
            + _owner(call)
            + "</Version>"
        )
    for p in page.prefixes:
        body.append("<CommonPrefixes>" + element("Prefix", _enc(p, url)) + "</CommonPrefixes>")
    return _xml(document("ListVersionsResult", body))
