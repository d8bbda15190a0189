"""One authenticated S3 request: who sent it, which bucket and key it names."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvstore.buckets import records
from kvstore.buckets.catalog import Bucket, Catalog, Dropped
from kvstore.buckets.names import valid_bucket_name
from kvstore.buckets.objects import Readers
from kvstore.engine.api import Store
from kvstore.transport.s3.body import UploadBody
from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.sigv4 import STREAMING_SIGNED, STREAMING_SIGNED_TRAILER, Authorization, ChunkSigner
from kvstore.transport.s3.xml import MAX_BODY

MAX_KEY_BYTES = 1024
SIGNED_STREAMING = (STREAMING_SIGNED, STREAMING_SIGNED_TRAILER)


@dataclass(frozen=True, slots=True)
class Settings:
    region: str
    domain: str | None  # virtual-host-style addressing: BUCKET.<domain>
    block_size: int  # bytes per block of an object
    max_object: int = 5 << 30  # S3's largest single PUT, and part


@dataclass
class Call:
    request: web.Request
    store: Store
    catalog: Catalog
    settings: Settings
    tenant: str
    incarnation: int
    auth: Authorization
    signing_key: bytes
    bucket_name: str | None
    key: bytes | None
    query: dict[str, str]
    request_id: str
    readers: Readers
    started: float = field(default_factory=time.time)

    @property
    def key_text(self) -> str:
        assert self.key is not None
        return self.key.decode()

    def q(self, name: str) -> str | None:
        return self.query.get(name)

    async def bucket(self) -> Bucket:
        """The bucket the request names, the caller's own: NoSuchBucket when
        it does not exist, AccessDenied when another tenant owns it."""
        name = self.bucket_name
        assert name is not None
        found = self.catalog.bucket_now(name)
        if found is not None and self.store.incarnation(found.tenant) != found.incarnation:
            await self.catalog.run(self.catalog.forget_bucket, name)  # its tenant was deleted
            found = None
        if found is None:
            raise S3Error("NoSuchBucket", "The specified bucket does not exist", BucketName=name)
        if found.tenant != self.tenant or found.incarnation != self.incarnation:
            raise S3Error("AccessDenied", "Access Denied")
        bucket = found  # its record touched (written again if gone): it lasts while the bucket is used
        await records.keep(self.store, self.tenant, bucket.record, lambda: records.of_bucket(bucket))
        return bucket

    def seal_meta(self, meta: dict[str, Any]) -> bytes:
        return records.seal_meta(self.store, self.tenant, meta)

    def open_meta(self, blob: bytes) -> dict[str, Any]:
        return records.open_meta(self.store, self.tenant, blob)

    async def put_record(self, key: str, rec: records.Record) -> None:
        await records.put(self.store, self.tenant, key, rec)

    async def discard(self, dropped: Dropped) -> None:
        """Delete what a committed change left unnamed: its records now, its
        blocks now or, for those a read holds, when the read ends."""
        await asyncio.gather(
            self.readers.retire(self.tenant, dropped.blocks),
            records.delete(self.store, self.tenant, dropped.records),
        )

    async def xml_body(self, checksums: bool = True) -> bytes:
        """A request's XML document, bounded in size and checked as an
        upload's body is (length, Content-MD5, payload hash, and the
        checksum headers when they are the body's: ``checksums``)."""
        signer = ChunkSigner(self.signing_key, self.auth) if self.auth.payload_hash in SIGNED_STREAMING else None
        body = UploadBody(
            self.request.content, self.request.headers, self.auth.payload_hash, signer, MAX_BODY, checksums
        )
        out = bytearray()
        try:
            async for data in body.chunks():
                out += data
        except S3Error as e:
            if e.s3_code == "IncompleteBody" and body.received > MAX_BODY:
                raise S3Error("MalformedXML", f"the XML document is over {MAX_BODY} bytes") from None
            raise
        body.finish()
        return bytes(out)


def validate_bucket_name(name: str) -> str:
    if not valid_bucket_name(name):
        raise S3Error(
            "InvalidBucketName",
            "The specified bucket is not valid: 3-63 characters of a-z 0-9 . -, starting and ending with a letter "
            "or digit, not an IP address",
            BucketName=name[:64],
        )
    return name


def validate_object_key(raw: str) -> bytes:
    try:
        key = raw.encode("utf-8", "strict")
    except UnicodeEncodeError:
        raise S3Error("InvalidArgument", "the object key is not valid UTF-8") from None
    if len(key) > MAX_KEY_BYTES:
        raise S3Error("KeyTooLongError", "Your key is too long")
    return key
