"""Binary framing of batch requests and responses (``application/x-kvstore-batch``).

``POST /v1/batch/put`` carries a stream of put items in its request body;
``POST /v1/batch/get`` answers with a stream of get items. Both are streamed:
the decoders here hold one block at a time, never a whole batch. The layout is
specified in docs/batch-framing.md; in short (integers little-endian)::

    stream   = MAGIC *item END          MAGIC = "KVB1" (or "KVB2"), END = u16 0
    put item = u16 key_len, key, u64 data_len, data
    put item = u16 key_len, key, u32 meta_len, meta, u64 data_len, data   (KVB2)
    get item = u16 key_len, key, u16 status, u64 payload_len, payload

``KVB2`` put items carry the block's engine identity: ``meta`` is the JSON
object of the ``Kvstore-Block-Meta`` header (not base64), ``meta_len`` 0
when an item has none.

``key_len`` is 1..256 (0 is the END marker) and the key is ASCII in the key
grammar (:mod:`kvstore_client.wire.keys`). A put item's ``data_len`` is
1..max_block_size. A get item's ``status`` is HTTP-like (200 found: the
payload is the block; 404 absent and every other status: the payload is
:func:`error_payload`, a UTF-8 JSON object ``{"code": ..., "message": ...}``).

Decoders read from any object with ``async readexactly(n) -> bytes`` that raises
:class:`asyncio.IncompleteReadError` at end of stream (aiohttp's and asyncio's
``StreamReader``). A malformed stream raises :class:`~kvstore_client.wire.errors.BadFraming`
whose message names the item (numbered from 0), the byte offset of the
offending field from the start of the stream, and what was wrong; a put item
larger than ``max_block_size`` raises :class:`~kvstore_client.wire.errors.TooLarge`
(the daemon answers them 400 and 413). Items yielded before the error were
well-formed. Encoders raise :class:`~kvstore_client.wire.errors.InvalidKey`
for a bad key and ValueError for a length or status out of range.

Both sides use this module: the daemon decodes put streams and encodes get
answers (kvstore/transport/batchframe.py gives its decoders the daemon's
errors), the client encodes put streams without copying the blocks
(:func:`put_stream_parts`) and decodes get answers.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, Protocol

from kvstore_client.wire.errors import BadFraming, InvalidKey, TooLarge
from kvstore_client.wire.keys import KEY_CHARS, KEY_MAX_LEN, check_key

CONTENT_TYPE = "application/x-kvstore-batch"
MAGIC = b"KVB1"
MAGIC_META = b"KVB2"  # put items with an engine identity each
META_MAX = 64 << 10
END = b"\x00\x00"  # a u16 key length of 0

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STATUS_LEN = struct.Struct("<HQ")
_U64_MAX = (1 << 64) - 1

Buffer = bytes | bytearray | memoryview
#: what blocks may be: any C-contiguous object with the buffer protocol (bytes,
#: bytearray, memoryview, numpy arrays...); ``Any`` because Python 3.11 has no
#: ``collections.abc.Buffer`` to name the protocol.
BufferLike = Any


class ByteReader(Protocol):
    """What the decoders read from: ``asyncio.StreamReader``, ``aiohttp.StreamReader``.
    A reader may also have ``async readblock(n) -> bytes | memoryview``: the
    put decoders read each block's data with it (the daemon receives blocks
    into pooled aligned memory that way), and everything else with
    ``readexactly``."""

    async def readexactly(self, n: int, /) -> bytes: ...


# -- encoding ------------------------------------------------------------------


def _key_bytes(key: str) -> bytes:
    return check_key(key).encode("ascii")


def put_item_header(key: str, data_len: int, meta: bytes | None = None) -> bytes:
    """The bytes before a put item's data: ``u16 key_len, key, u64 data_len``,
    or with ``meta`` (b"" for none) the KVB2 layout ``u16 key_len, key, u32
    meta_len, meta, u64 data_len``.

    Raises InvalidKey for a bad key, ValueError for ``data_len`` outside
    1..2**64-1 or a meta over 64 KiB.
    """
    if not 1 <= data_len <= _U64_MAX:
        raise ValueError(f"data_len must be 1 to 2**64-1 (blocks are never empty), got {data_len}")
    k = _key_bytes(key)
    if meta is None:
        return _U16.pack(len(k)) + k + _U64.pack(data_len)
    if len(meta) > META_MAX:
        raise ValueError(f"a meta of {len(meta)} bytes is over {META_MAX}")
    return _U16.pack(len(k)) + k + _U32.pack(len(meta)) + meta + _U64.pack(data_len)


def get_item_header(key: str, status: int, payload_len: int) -> bytes:
    """The bytes before a get item's payload: ``u16 key_len, key, u16 status, u64 payload_len``.

    Raises InvalidKey for a bad key, ValueError for a status outside 100..599 or a
    ``payload_len`` outside 0..2**64-1.
    """
    if not 100 <= status <= 599:
        raise ValueError(f"status must be an HTTP status 100-599, got {status}")
    if not 0 <= payload_len <= _U64_MAX:
        raise ValueError(f"payload_len must be 0 to 2**64-1, got {payload_len}")
    k = _key_bytes(key)
    return _U16.pack(len(k)) + k + _STATUS_LEN.pack(status, payload_len)


def error_payload(code: str, message: str) -> bytes:
    """The payload of a get item whose status is not 200: UTF-8 JSON
    ``{"code": code, "message": message}`` (the daemon's error code)."""
    return json.dumps({"code": code, "message": message}, ensure_ascii=False).encode()


def put_stream_parts(
    items: Iterable[tuple[str, BufferLike]], metas: Iterable[bytes | None] | None = None
) -> list[BufferLike]:
    """A batch/put request body as a list of parts: the blocks are not
    copied (send the parts as they are, or join them). With ``metas`` (each
    item's identity as JSON bytes, or None), KVB2."""
    parts: list[BufferLike] = [MAGIC if metas is None else MAGIC_META]
    ids = iter(metas) if metas is not None else None
    for key, data in items:
        meta = (next(ids) or b"") if ids is not None else None
        parts += (put_item_header(key, memoryview(data).nbytes, meta), data)
    parts.append(END)
    return parts


def encode_put_stream(items: Iterable[tuple[str, BufferLike]], metas: Iterable[bytes | None] | None = None) -> bytes:
    """A whole batch/put request body in memory (for tests and small clients)."""
    return b"".join(put_stream_parts(items, metas))


def encode_get_stream(items: Iterable[tuple[str, int, Buffer]]) -> bytes:
    """A whole batch/get response body in memory (for tests)."""
    parts: list[Buffer] = [MAGIC]
    for key, status, payload in items:
        parts += (get_item_header(key, status, memoryview(payload).nbytes), payload)
    parts.append(END)
    return b"".join(parts)


# -- decoding ------------------------------------------------------------------


class _Cursor:
    """A reader that counts bytes and turns an early end of stream into BadFraming."""

    def __init__(self, reader: ByteReader) -> None:
        self._reader = reader
        self.offset = 0

    async def read(self, n: int, what: str) -> bytes:
        data: bytes = await self._counted(self._reader.readexactly(n), n, what)
        return data

    async def block(self, n: int, what: str) -> Buffer:
        """``n`` bytes of a block's data: through the reader's ``readblock`` if it has one."""
        readblock = getattr(self._reader, "readblock", None)
        if readblock is None:
            return await self.read(n, what)
        data: Buffer = await self._counted(readblock(n), n, what)
        return data

    async def _counted(self, read: Awaitable[Any], n: int, what: str) -> Any:
        """The result of ``read`` (``n`` bytes of ``what``), counted; an early end is BadFraming."""
        try:
            data = await read
        except asyncio.IncompleteReadError as e:
            raise BadFraming(
                f"truncated stream: {what} at byte offset {self.offset}: expected {n} bytes, "
                f"the stream ended after {len(e.partial)}"
            ) from None
        self.offset += n
        return data

    async def magic(self, allowed: tuple[bytes, ...] = (MAGIC,)) -> bytes:
        magic = await self.read(len(MAGIC), "the 4-byte magic")
        if magic not in allowed:
            expected = " or ".join(repr(m) for m in allowed)
            raise BadFraming(f"bad magic {magic!r} at byte offset 0: expected {expected} ({CONTENT_TYPE})")
        return magic

    async def key(self, index: int, max_items: int | None = None) -> str | None:
        """Item ``index``'s key, or None at the end marker (then checks that nothing follows)."""
        at = self.offset
        (key_len,) = _U16.unpack(await self.read(2, f"item {index}: key length (or the end marker 00 00)"))
        if key_len == 0:
            try:
                extra = await self._reader.readexactly(1)
            except asyncio.IncompleteReadError:
                return None
            raise BadFraming(
                f"unexpected data {extra!r}... at byte offset {self.offset}, after the end marker "
                f"that follows {index} items"
            )
        if max_items is not None and index >= max_items:
            raise BadFraming(f"item {index} at byte offset {at}: a batch holds at most {max_items} items")
        if key_len > KEY_MAX_LEN:
            raise BadFraming(f"item {index}: key length {key_len} at byte offset {at}: expected 1 to {KEY_MAX_LEN}")
        at = self.offset
        raw = await self.read(key_len, f"item {index}: {key_len}-byte key")
        if not raw.isascii():
            pos = next(i for i, byte in enumerate(raw) if byte > 0x7F)
            raise BadFraming(
                f"item {index}: invalid key at byte offset {at}: byte 0x{raw[pos]:02x} at position {pos} "
                f"is not ASCII; allowed characters are {KEY_CHARS}"
            )
        try:
            return check_key(raw.decode("ascii"))
        except InvalidKey as e:
            raise BadFraming(f"item {index}: invalid key at byte offset {at}: {e}") from None


async def read_put_items(reader: ByteReader, max_block_size: int, max_items: int) -> AsyncIterator[tuple[str, Buffer]]:
    """Decode a batch/put request body, yielding ``(key, data)`` one item at
    a time (a KVB2 stream's identities are dropped: see read_put_items_meta)."""
    async for key, data, _ in read_put_items_meta(reader, max_block_size, max_items):
        yield key, data


async def read_put_items_meta(
    reader: ByteReader, max_block_size: int, max_items: int
) -> AsyncIterator[tuple[str, Buffer, bytes | None]]:
    """Decode a batch/put request body (KVB1 or KVB2), yielding ``(key,
    data, meta)`` one item at a time; ``meta`` is the item's identity as
    JSON bytes, None when it has none.

    Raises BadFraming for a bad magic, a key length over 256, an invalid
    key, a ``meta_len`` over 64 KiB, a ``data_len`` of 0, more than
    ``max_items`` items, a stream that ends before the end marker or has data
    after it; TooLarge for a ``data_len`` over ``max_block_size``, before
    reading the data.
    """
    if max_block_size < 1 or max_items < 1:
        raise ValueError(f"max_block_size and max_items must be positive, got {max_block_size}, {max_items}")
    cur = _Cursor(reader)
    with_meta = await cur.magic((MAGIC, MAGIC_META)) == MAGIC_META
    index = 0
    while True:
        key = await cur.key(index, max_items)
        if key is None:
            return
        meta = None
        if with_meta:
            at = cur.offset
            (meta_len,) = _U32.unpack(await cur.read(4, f"item {index} ({key}): 4-byte meta length"))
            if meta_len > META_MAX:
                raise BadFraming(f"item {index} ({key}): meta length {meta_len} at byte offset {at}: over {META_MAX}")
            if meta_len:
                meta = await cur.read(meta_len, f"item {index} ({key}): {meta_len}-byte meta")
        at = cur.offset
        (data_len,) = _U64.unpack(await cur.read(8, f"item {index} ({key}): 8-byte data length"))
        if data_len == 0:
            raise BadFraming(f"item {index} ({key}): data length 0 at byte offset {at}: blocks are 1 byte or more")
        if data_len > max_block_size:
            raise TooLarge(
                f"item {index} ({key}): data length {data_len} at byte offset {at} exceeds "
                f"the maximum block size {max_block_size}"
            )
        data = await cur.block(data_len, f"item {index} ({key}): {data_len}-byte data")
        yield key, data, meta
        index += 1


async def read_get_items(
    reader: ByteReader, *, max_payload: int | None = None
) -> AsyncIterator[tuple[str, int, bytes]]:
    """Decode a batch/get response body, yielding ``(key, status, payload)`` one item at a time.

    ``payload`` is the block for status 200 and :func:`error_payload` JSON for
    any other status. Raises BadFraming for a bad magic, a key length over 256,
    an invalid key, a status outside 100..599, a 200 with an empty payload, a
    ``payload_len`` over ``max_payload`` (if given), a stream that ends before
    the end marker or has data after it.
    """
    cur = _Cursor(reader)
    await cur.magic()
    index = 0
    while True:
        key = await cur.key(index)
        if key is None:
            return
        at = cur.offset
        status, payload_len = _STATUS_LEN.unpack(
            await cur.read(_STATUS_LEN.size, f"item {index} ({key}): 2-byte status and 8-byte payload length")
        )
        if not 100 <= status <= 599:
            raise BadFraming(f"item {index} ({key}): status {status} at byte offset {at}: expected 100 to 599")
        if status == 200 and payload_len == 0:
            raise BadFraming(f"item {index} ({key}): status 200 with an empty payload at byte offset {at}")
        if max_payload is not None and payload_len > max_payload:
            raise BadFraming(
                f"item {index} ({key}): payload length {payload_len} at byte offset {at + 2} "
                f"exceeds the limit {max_payload}"
            )
        payload = await cur.read(payload_len, f"item {index} ({key}): {payload_len}-byte payload")
        yield key, status, payload
        index += 1
