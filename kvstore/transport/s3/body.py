"""Request bodies of S3 uploads: plain or ``aws-chunked``, verified as they stream.

:class:`UploadBody` yields the object's bytes and, once the body has ended,
checks everything the client said about them: the length
(``Content-Length``, ``x-amz-decoded-content-length``), ``Content-MD5``,
``x-amz-content-sha256`` when it is a hash, each chunk's signature in a
signed streaming upload (and the trailer's), and the ``x-amz-checksum-*``
value sent as a header or a trailer. The caller stores what it is given and
throws it away if :meth:`UploadBody.finish` raises.

Streaming framing (S3's "Signature Version 4: chunked upload"):
``hex-size[;chunk-signature=SIG]\\r\\n DATA \\r\\n`` ... a chunk of size 0,
then, for the ``-TRAILER`` variants, trailer lines ``name:value\\r\\n`` (with
``x-amz-trailer-signature`` last when signed) and an empty line.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import StreamReader

from kvstore.transport.s3.errors import S3Error
from kvstore.transport.s3.sigv4 import (
    STREAMING,
    STREAMING_SIGNED,
    STREAMING_SIGNED_TRAILER,
    STREAMING_UNSIGNED_TRAILER,
    UNSIGNED_PAYLOAD,
    ChunkSigner,
)

MAX_CHUNK_LINE = 4096
MAX_TRAILER = 16 << 10
READ_SIZE = 1 << 20


class _Crc:
    """A CRC as hashlib's interface: update, then the big-endian digest."""

    def __init__(self, fn: Callable[[Any, int], int], width: int) -> None:
        self._fn = fn
        self._value = 0
        self._width = width

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._value = self._fn(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(self._width, "big")


def _crc_factories() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {
        "crc32": lambda: _Crc(zlib.crc32, 4),
        "sha1": hashlib.sha1,
        "sha256": hashlib.sha256,
    }
    try:  # the AWS CRT's CRC32C and CRC64NVME (botocore uses it for them too)
        from awscrt import checksums

        out["crc32c"] = lambda: _Crc(checksums.crc32c, 4)
        out["crc64nvme"] = lambda: _Crc(checksums.crc64nvme, 8)
    except ImportError:  # pragma: no cover - awscrt is a dependency
        pass
    return out


CHECKSUMS = _crc_factories()
ALL_CHECKSUMS = ("crc32", "crc32c", "crc64nvme", "sha1", "sha256")


def checksum_header(headers: Any) -> tuple[str, str | None] | None:
    """(algorithm, value or None when it comes in a trailer) the client sent."""
    trailer = (headers.get("x-amz-trailer") or "").strip().lower()
    for algo in ALL_CHECKSUMS:
        value = headers.get("x-amz-checksum-" + algo)
        if value is not None:
            return algo, value.strip()
        if trailer == "x-amz-checksum-" + algo:
            return algo, None
    if trailer:
        raise S3Error("InvalidRequest", f"x-amz-trailer {trailer[:64]!r} is not a checksum this server knows")
    algo = (headers.get("x-amz-sdk-checksum-algorithm") or headers.get("x-amz-checksum-algorithm") or "").lower()
    if algo and algo not in ALL_CHECKSUMS:
        raise S3Error("InvalidRequest", f"checksum algorithm {algo[:32]!r} is not supported")
    return None


class UploadBody:
    """The bytes of one upload, verified as they come (see the module doc)."""

    def __init__(
        self,
        content: StreamReader,
        headers: Any,
        payload_hash: str,
        signer: ChunkSigner | None,
        max_size: int,
        checksums: bool = True,
    ) -> None:
        """``checksums``: whether ``x-amz-checksum-*`` headers are this body's
        (CompleteMultipartUpload's are the whole object's, not its XML's)."""
        self._content = content
        self._payload_hash = payload_hash
        self._signer = signer
        self._streaming = payload_hash in STREAMING
        if payload_hash in (STREAMING_SIGNED, STREAMING_SIGNED_TRAILER) and signer is None:
            raise S3Error("InvalidRequest", "a signed streaming upload needs header authentication")
        length = headers.get("Content-Length")
        if length is None and not (headers.get("Transfer-Encoding") or "").lower().endswith("chunked"):
            raise S3Error("MissingContentLength", "You must provide the Content-Length HTTP header.")
        self._wire_length = int(length) if length is not None and length.isdigit() else None
        if length is not None and self._wire_length is None:
            raise S3Error("InvalidArgument", "Content-Length must be a decimal number")
        decoded = headers.get("x-amz-decoded-content-length")
        if self._streaming:
            if decoded is None or not decoded.isdigit():
                raise S3Error("MissingContentLength", "x-amz-decoded-content-length is required for a streaming upload")
            self.size = int(decoded)
        else:
            self.size = self._wire_length if self._wire_length is not None else -1
        if self.size > max_size:
            raise S3Error(
                "EntityTooLarge", f"Your proposed upload exceeds the maximum allowed size of {max_size} bytes"
            )
        self._max_size = max_size
        md5 = headers.get("Content-MD5")
        self._md5_expected: bytes | None = None
        if md5 is not None:
            try:
                self._md5_expected = base64.b64decode(md5.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise S3Error("InvalidDigest", "The Content-MD5 you specified was not valid.") from None
            if len(self._md5_expected) != 16:
                raise S3Error("InvalidDigest", "The Content-MD5 you specified was not valid.")
        self.md5 = hashlib.md5(usedforsecurity=False)
        self._sha256 = hashlib.sha256() if payload_hash not in STREAMING and payload_hash != UNSIGNED_PAYLOAD else None
        found = checksum_header(headers) if checksums else None
        self.checksum_algorithm: str | None = None
        self._checksum_expected: str | None = None
        self._checksum: Any = None
        if found is not None:
            algo, value = found
            if algo not in CHECKSUMS:
                raise S3Error("InvalidRequest", f"checksum algorithm {algo.upper()} is not supported by this server")
            if value is None and payload_hash not in (STREAMING_UNSIGNED_TRAILER, STREAMING_SIGNED_TRAILER):
                raise S3Error("InvalidRequest", "x-amz-trailer needs a streaming upload with a trailer")
            self.checksum_algorithm, self._checksum_expected = algo, value
            self._checksum = CHECKSUMS[algo]()
        self.checksum_value: str | None = None
        self.received = 0
        self._trailer: dict[str, str] = {}

    def _take(self, data: bytes | bytearray | memoryview) -> None:
        self.received += len(data)
        if self.received > self._max_size or (self.size >= 0 and self.received > self.size):
            raise S3Error("IncompleteBody", "The request body is longer than its declared length")
        self.md5.update(data)
        if self._sha256 is not None:
            self._sha256.update(data)
        if self._checksum is not None:
            self._checksum.update(data)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The object's bytes, in pieces of at most :data:`READ_SIZE`."""
        if not self._streaming:
            while True:
                data = await self._content.read(READ_SIZE)
                if not data:
                    return
                self._take(data)
                yield data
        else:
            async for data in self._aws_chunked():
                yield data

    async def _line(self, what: str) -> bytes:
        try:
            line = await self._content.readuntil(b"\r\n")
        except ValueError:
            raise S3Error("IncompleteBody", f"a {what} line of the streaming body is too long") from None
        if not line.endswith(b"\r\n") or len(line) > MAX_CHUNK_LINE:
            raise S3Error("IncompleteBody", f"the streaming body ended inside a {what} line")
        return line[:-2]

    async def _aws_chunked(self) -> AsyncIterator[bytes]:
        signed = self._payload_hash in (STREAMING_SIGNED, STREAMING_SIGNED_TRAILER)
        while True:
            header = (await self._line("chunk header")).decode("ascii", "replace")
            size_text, _, ext = header.partition(";")
            try:
                size = int(size_text.strip(), 16)
            except ValueError:
                raise S3Error("IncompleteBody", "a chunk header of the streaming body is malformed") from None
            signature = ext.partition("chunk-signature=")[2].strip() if ext else ""
            if signed and not signature:
                raise S3Error("SignatureDoesNotMatch", "a chunk of a signed streaming upload has no signature")
            if size > self._max_size:
                raise S3Error("InvalidChunkSizeError", "a chunk of the streaming body is larger than the object")
            remaining = size
            digest = hashlib.sha256() if signed else None
            while remaining:
                try:
                    data = await self._content.readexactly(min(remaining, READ_SIZE))
                except asyncio.IncompleteReadError:
                    raise S3Error("IncompleteBody", "the streaming body ended inside a chunk") from None
                remaining -= len(data)
                if digest is not None:
                    digest.update(data)
                    if remaining == 0 and self._signer is not None:
                        self._signer.check_chunk(digest.hexdigest(), signature)
                self._take(data)
                yield data
            if size == 0:
                if signed and self._signer is not None:
                    self._signer.check_chunk(hashlib.sha256().hexdigest(), signature)
                break
            if await self._line("chunk end") != b"":
                raise S3Error("IncompleteBody", "a chunk of the streaming body is longer than its header says")
        if self._payload_hash in (STREAMING_UNSIGNED_TRAILER, STREAMING_SIGNED_TRAILER):
            await self._read_trailer()

    async def _read_trailer(self) -> None:
        lines: list[bytes] = []
        total = 0
        while True:
            line = await self._line("trailer")
            if line == b"":
                break
            total += len(line)
            if total > MAX_TRAILER:
                raise S3Error("IncompleteBody", "the trailer of the streaming body is too long")
            lines.append(line)
        signature = None
        signed_part = b""
        for line in lines:
            name, _, value = line.decode("utf-8", "replace").partition(":")
            name = name.strip().lower()
            if name == "x-amz-trailer-signature":
                signature = value.strip()
            else:
                self._trailer[name] = value.strip()
                signed_part += line + b"\n"
        if self._payload_hash == STREAMING_SIGNED_TRAILER:
            if signature is None or self._signer is None:
                raise S3Error("SignatureDoesNotMatch", "the trailer of a signed streaming upload has no signature")
            self._signer.check_trailer(signed_part, signature)

    def finish(self) -> None:
        """Check the whole body against what the client declared."""
        if self.size >= 0 and self.received != self.size:
            raise S3Error(
                "IncompleteBody", "You did not provide the number of bytes specified by the Content-Length HTTP header"
            )
        if self._md5_expected is not None and self.md5.digest() != self._md5_expected:
            raise S3Error("BadDigest", "The Content-MD5 you specified did not match what we received.")
        if self._sha256 is not None and self._sha256.hexdigest() != self._payload_hash:
            raise S3Error(
                "XAmzContentSHA256Mismatch",
                "The provided 'x-amz-content-sha256' header does not match what was computed.",
            )
        if self._checksum is not None and self.checksum_algorithm is not None:
            expected = self._checksum_expected
            if expected is None:
                expected = self._trailer.get("x-amz-checksum-" + self.checksum_algorithm)
                if expected is None:
                    raise S3Error("InvalidRequest", "the streaming body's trailer lacks the checksum it announced")
            value = base64.b64encode(self._checksum.digest()).decode()
            if value != expected:
                raise S3Error(
                    "BadDigest",
                    f"The {self.checksum_algorithm.upper()} you specified did not match the calculated checksum.",
                )
            self.checksum_value = value
