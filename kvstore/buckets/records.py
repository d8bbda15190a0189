"""The gateway's records: what the catalog says, as blocks of the bucket's tenant.

The catalog (:mod:`.catalog`) is a cache, as the LMDB index is a cache of
the segments: every row that must outlive the disk (a bucket, an object, a
multipart upload in progress and each of its parts) is also a small block
of the bucket's tenant, written through the store. So it is sealed and
compressed by the tenant's policy, mirrored to the object tier with the
tenant's segments (``POST /v1/admin/flush`` waits for it), removed by a
tombstone when the row goes, and carried by compaction; a node rebuilt from
its bucket rebuilds its catalog from the records (:mod:`.recovery`).

Keys (the prefix ``s3m~`` is the gateway's, as ``s3~`` of the objects'
bytes is)::

    s3m~b~<ruid>   a bucket: name, region, created
    s3m~o~<ruid>   an object: bucket, key, size, ETag, mtime, metadata, blocks
    s3m~u~<ruid>   a multipart upload in progress: id, bucket, key, created, metadata
    s3m~p~<ruid>   one of its parts: upload id, number, size, ETag, mtime, blocks

``ruid`` is fresh for every record: a change writes a new record rather than
rewriting one (a second put of a key is a no-op in the store), and no name
is in a block key (block keys are in the clear in the segments' footers and
in the object tier). Object keys, any UTF-8, are base64 in the payload.

Order of a change: the new record is written (durable once ``store.put``
returns; with an object's last block, in one group commit), the catalog
row committed, then the records it replaced are deleted. A crash between
leaves a record the catalog does not name (deleted at the next start-up)
or, rebuilding from the bucket, two versions of one object (the newer
wins).

The payload is JSON; for a sealed tenant it is also sealed under the
tenant's data key (AES-GCM bound to the tenant and the record's key, like
the catalog's metadata) before the store seals the block. A tenant cannot
write or delete blocks under ``s3m~`` or ``s3~`` over ``/v1`` or NIXL
(names.validate_client_key); blocks found there that the gateway did not
write (a sealed tenant's that it cannot open) are deleted at start-up and
skipped by a rebuild.

Records are blocks like the others: a tenant's quota (least recently used
first) and TTL can remove them. Any request naming a bucket touches its
record, reading an object the object's, any call on an upload the
upload's (:func:`keep`: and writes it again if it is gone), so each lasts
as long as what it names is used; a row whose record is missing gets it
written again at start-up.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore_client.wire.sealing import aad

from kvstore.buckets.catalog import Bucket, Extents, ObjectRow, PartRow, Upload
from kvstore.buckets.names import valid_bucket_name
from kvstore.engine.api import Store
from kvstore.errors import CorruptionError, KVStoreError, NewerFormat, NotFound
from kvstore.names import S3_DATA_PREFIX, S3_RECORD_PREFIX, validate_key

log = logging.getLogger("kvstore.s3")

PREFIX = S3_RECORD_PREFIX
BUCKET, OBJECT, UPLOAD, PART = "b", "o", "u", "p"
DATA_PREFIX = S3_DATA_PREFIX  # the objects' bytes (objects.PREFIX): a record names blocks only there
_VERSION = 1  # "v" of every record written; docs/operations.md lists every persisted format's version
VERSIONS_READ = (1,)  # a newer "v" is refused (NewerFormat): the gateway stops, the record stays
DELETE_AT_ONCE = 64
_META_AAD = b"kvstore/v1 s3 object meta\x00"
_RECORD_AAD = b"kvstore/v1 s3 record"
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")  # as multipart_ops makes them


def key_of(kind: str, ruid: str) -> str:
    return f"{PREFIX}{kind}~{ruid}"


def kind_of(key: str) -> str | None:
    """The kind of a record's key (:data:`BUCKET`, ...), None if it is none."""
    if not key.startswith(PREFIX) or len(key) < len(PREFIX) + 3 or key[len(PREFIX) + 1] != "~":
        return None
    kind = key[len(PREFIX)]
    return kind if kind in (BUCKET, OBJECT, UPLOAD, PART) else None


# -- metadata as the catalog keeps it -----------------------------------------------


def seal_meta(store: Store, tenant: str, meta: dict[str, Any]) -> bytes:
    """An object's metadata as the catalog stores it: sealed under the
    tenant's data key for a sealed tenant."""
    return store.seal_for(tenant, json.dumps(meta, separators=(",", ":")).encode(), _META_AAD + tenant.encode())


def open_meta(store: Store, tenant: str, blob: bytes) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(store.open_for(tenant, blob, _META_AAD + tenant.encode()))
    return out


# -- what a record says ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BucketRecord:
    name: str
    region: str
    created_ns: int


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    bucket: str
    key: bytes
    size: int
    etag: str
    mtime_ns: int
    meta: dict[str, Any]
    blocks: Extents


@dataclass(frozen=True, slots=True)
class UploadRecord:
    upload_id: str
    bucket: str
    key: bytes
    created_ns: int
    meta: dict[str, Any]


@dataclass(frozen=True, slots=True)
class PartRecord:
    upload_id: str
    part: int
    size: int
    etag: str
    mtime_ns: int
    blocks: Extents


Record = BucketRecord | ObjectRecord | UploadRecord | PartRecord
_KINDS: dict[type, str] = {BucketRecord: BUCKET, ObjectRecord: OBJECT, UploadRecord: UPLOAD, PartRecord: PART}


def of_bucket(b: Bucket) -> BucketRecord:
    return BucketRecord(b.name, b.region, b.created_ns)


def of_object(bucket: str, row: ObjectRow, meta: dict[str, Any]) -> ObjectRecord:
    return ObjectRecord(bucket, row.key, row.size, row.etag, row.mtime_ns, meta, row.blocks)


def of_upload(u: Upload, meta: dict[str, Any]) -> UploadRecord:
    return UploadRecord(u.upload_id, u.bucket, u.key, u.created_ns, meta)


def of_part(upload_id: str, p: PartRow) -> PartRecord:
    return PartRecord(upload_id, p.part, p.size, p.etag, p.mtime_ns, p.blocks)


def _pack_blocks(extents: Extents) -> list[Any]:
    """Extents, the blocks of one upload run together: ``[uid, first n,
    [[length, count], ...]]`` for ``s3~<uid>~<n>``, ``n`` counting up (a
    5 GiB object of 16 MiB blocks is one short item); ``[key, length]``
    for any other key."""
    out: list[Any] = []
    for key, length in extents:
        uid, _, n_text = key.removeprefix(DATA_PREFIX).rpartition("~")
        if key.startswith(DATA_PREFIX) and uid and n_text.isdigit() and str(int(n_text)) == n_text:
            n = int(n_text)
            last = out[-1] if out else None
            if last is not None and len(last) == 3 and last[0] == uid and last[1] + sum(c for _, c in last[2]) == n:
                runs = last[2]
                if runs[-1][0] == length:
                    runs[-1][1] += 1
                else:
                    runs.append([length, 1])
                continue
            out.append([uid, n, [[length, 1]]])
        else:
            out.append([key, length])
    return out


def _unpack_blocks(items: Any) -> Extents:
    if not isinstance(items, list):
        raise ValueError("blocks")
    out: Extents = []
    for item in items:
        if isinstance(item, list) and len(item) == 2:
            out.append((_block_key(item[0]), _count(item[1])))
        elif isinstance(item, list) and len(item) == 3 and isinstance(item[2], list):
            uid, n = _text(item[0]), _count(item[1])
            for run in item[2]:
                if not isinstance(run, list) or len(run) != 2:
                    raise ValueError("blocks")
                length, count = _count(run[0]), _count(run[1])
                if count > 1 << 24:
                    raise ValueError("blocks")
                for _ in range(count):
                    out.append((_block_key(f"{DATA_PREFIX}{uid}~{n}"), length))
                    n += 1
        else:
            raise ValueError("blocks")
    return out


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("not a string")
    return v


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise ValueError("not a count")
    return v


def _block_key(v: Any) -> str:
    key = validate_key(_text(v))
    if not key.startswith(DATA_PREFIX):
        raise ValueError("a block outside the objects' prefix")
    return key


def _bucket(v: Any) -> str:
    if not valid_bucket_name(_text(v)):
        raise ValueError("bucket name")
    return str(v)


def _upload_id(v: Any) -> str:
    if _UPLOAD_ID.fullmatch(_text(v)) is None:
        raise ValueError("upload id")
    return str(v)


def _meta(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError("meta")
    return v


def _object_key(v: Any) -> bytes:
    raw = base64.b64decode(_text(v), validate=True)
    raw.decode("utf-8", "strict")
    if len(raw) > 1024:
        raise ValueError("object key")
    return raw


def _doc(rec: Record) -> dict[str, Any]:
    if isinstance(rec, BucketRecord):
        return {"name": rec.name, "region": rec.region, "created": rec.created_ns}
    if isinstance(rec, ObjectRecord):
        return {
            "bucket": rec.bucket,
            "key": base64.b64encode(rec.key).decode(),
            "size": rec.size,
            "etag": rec.etag,
            "mtime": rec.mtime_ns,
            "meta": rec.meta,
            "blocks": _pack_blocks(rec.blocks),
        }
    if isinstance(rec, UploadRecord):
        return {
            "id": rec.upload_id,
            "bucket": rec.bucket,
            "key": base64.b64encode(rec.key).decode(),
            "created": rec.created_ns,
            "meta": rec.meta,
        }
    return {
        "upload": rec.upload_id,
        "part": rec.part,
        "size": rec.size,
        "etag": rec.etag,
        "mtime": rec.mtime_ns,
        "blocks": _pack_blocks(rec.blocks),
    }


def _record(kind: str, d: dict[str, Any]) -> Record:
    if kind == BUCKET:
        return BucketRecord(_bucket(d["name"]), _text(d["region"]), _count(d["created"]))
    if kind == OBJECT:
        return ObjectRecord(
            _bucket(d["bucket"]),
            _object_key(d["key"]),
            _count(d["size"]),
            _text(d["etag"]),
            _count(d["mtime"]),
            _meta(d["meta"]),
            _unpack_blocks(d["blocks"]),
        )
    if kind == UPLOAD:
        return UploadRecord(
            _upload_id(d["id"]),
            _bucket(d["bucket"]),
            _object_key(d["key"]),
            _count(d["created"]),
            _meta(d["meta"]),
        )
    part = _count(d["part"])
    if not 1 <= part <= 10_000:
        raise ValueError("part number")
    return PartRecord(
        _upload_id(d["upload"]),
        part,
        _count(d["size"]),
        _text(d["etag"]),
        _count(d["mtime"]),
        _unpack_blocks(d["blocks"]),
    )


def _aad(tenant: str, key: str) -> bytes:
    return aad(_RECORD_AAD, tenant, key)


def encode(store: Store, tenant: str, key: str, rec: Record) -> bytes:
    """The block that stores ``rec`` under ``key``."""
    if kind_of(key) != _KINDS[type(rec)]:
        raise ValueError(f"a {type(rec).__name__} cannot be stored under {key!r}")
    doc = {"v": _VERSION, **_doc(rec)}
    return store.seal_for(tenant, json.dumps(doc, separators=(",", ":")).encode(), _aad(tenant, key))


def decode(store: Store, tenant: str, key: str, blob: bytes | bytearray) -> Record:
    """What the block under ``key`` says; :class:`CorruptionError` if it is
    not a record the gateway wrote (damaged, forged, another format)."""
    kind = kind_of(key)
    if kind is None:
        raise CorruptionError(f"{key!r} is not a gateway record's key")
    try:
        doc = json.loads(store.open_for(tenant, bytes(blob), _aad(tenant, key)))
        v = doc.get("v") if isinstance(doc, dict) else None
        if NewerFormat.is_newer(v, VERSIONS_READ):
            # Not corruption: a record the gateway skips as damaged is deleted.
            raise NewerFormat(f"gateway record {key!r} of tenant {tenant!r}", v, VERSIONS_READ)
        if not isinstance(doc, dict) or v not in VERSIONS_READ:
            raise ValueError("format version")
        return _record(kind, doc)
    except (CorruptionError, NewerFormat):
        raise
    except (KVStoreError, ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError) as e:
        # Only the exception's type is named: its text may quote plaintext.
        what = type(e).__name__
        raise CorruptionError(f"gateway record {key!r} of tenant {tenant!r} is unreadable: {what}") from None


# -- writes -----------------------------------------------------------------------------


async def put(store: Store, tenant: str, key: str, rec: Record) -> None:
    """Write ``rec`` under ``key``, durable when this returns."""
    await store.put(tenant, key, encode(store, tenant, key, rec))


async def delete(store: Store, tenant: str, keys: list[str]) -> None:
    """Delete records the catalog no longer names, several at a time (their
    tombstones share group commits); a failure is logged, not raised (the
    record is deleted at the next start-up)."""
    for i in range(0, len(keys), DELETE_AT_ONCE):
        batch = keys[i : i + DELETE_AT_ONCE]
        done = await asyncio.gather(*(store.delete(tenant, k) for k in batch), return_exceptions=True)
        for key, r in zip(batch, done, strict=True):
            if isinstance(r, KVStoreError):
                log.warning("could not delete gateway record %s of tenant %s: %s", key, tenant, r.code)
            elif isinstance(r, BaseException):
                raise r


async def keep(store: Store, tenant: str, key: str, rec: Callable[[], Record]) -> None:
    """Touch the record (its access time, for the quota's LRU order and the
    TTL: as recent as the object read); write it again if it is gone.
    ``rec``: a callable giving the record, called only then. Never raises:
    a read must not fail for its record; a record still missing is written
    at the next start-up."""
    if not key:
        return
    try:
        await store.head(tenant, key)
        return
    except NotFound:
        pass
    except KVStoreError as e:
        log.warning("could not touch gateway record %s of tenant %s: %s", key, tenant, e.code)
        return
    try:
        await put(store, tenant, key, rec())
    except KVStoreError as e:
        log.warning("could not write gateway record %s of tenant %s again: %s", key, tenant, e.code)
