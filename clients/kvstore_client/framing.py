"""Binary framing of ``/v1/batch/put`` bodies and ``/v1/batch/get`` answers.

A client-side re-implementation of docs/batch-framing.md (the server package
is not a dependency). Integers are little-endian::

    stream   = MAGIC *item END          MAGIC = "KVB1" (or "KVB2"), END = u16 0
    put item = u16 key_len, key, u64 data_len, data
    put item = u16 key_len, key, u32 meta_len, meta, u64 data_len, data   (KVB2)
    get item = u16 key_len, key, u16 status, u64 payload_len, payload

A KVB2 put item carries the block's engine identity (``meta``: the JSON of
``Kvstore-Block-Meta``; ``meta_len`` 0 for none).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, Protocol

from kvstore_client.errors import InvalidKeyError, ProtocolError

CONTENT_TYPE = "application/x-kvstore-batch"
MAGIC = b"KVB1"
MAGIC_META = b"KVB2"
META_HEADER = "Kvstore-Block-Meta"
END = b"\x00\x00"
KEY_MAX_LEN = 256

_KEY_RE = re.compile(r"[A-Za-z0-9._~:@=+\-]{1,256}")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_STATUS_LEN = struct.Struct("<HQ")

Buffer = bytes | bytearray | memoryview
#: what blocks may be: any C-contiguous object with the buffer protocol (bytes,
#: bytearray, memoryview, numpy arrays...); ``Any`` because Python 3.11 has no
#: ``collections.abc.Buffer`` to name the protocol.
BufferLike = Any


class ByteReader(Protocol):
    """``aiohttp.StreamReader`` / ``asyncio.StreamReader``."""

    async def readexactly(self, n: int, /) -> bytes: ...


def check_key(key: str) -> str:
    """``key`` if it matches the server's key grammar, else InvalidKeyError."""
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise InvalidKeyError(f"invalid key {key!r}: expected 1-256 characters of [A-Za-z0-9._~:@=+-]")
    return key


def put_item_header(key: str, data_len: int, meta: bytes | None = None) -> bytes:
    """A put item's header; with ``meta`` (b"" for none), the KVB2 layout."""
    if not 1 <= data_len < 1 << 64:
        raise ValueError(f"blocks are 1 byte or more, got {data_len} for {key!r}")
    k = check_key(key).encode("ascii")
    if meta is None:
        return _U16.pack(len(k)) + k + _U64.pack(data_len)
    return _U16.pack(len(k)) + k + _U32.pack(len(meta)) + meta + _U64.pack(data_len)


def meta_json(meta: Mapping[str, Any]) -> bytes:
    """A block identity (``block_hash``, ``parent_block_hash``, ``token_ids``,
    ``block_size``, ``lora_id``, ``lora_name``, ``extra_keys``) as compact JSON."""
    if "block_hash" not in meta:
        raise ValueError("a block identity needs 'block_hash'")
    return json.dumps(dict(meta), separators=(",", ":")).encode()


def meta_header(meta: Mapping[str, Any]) -> str:
    """The ``Kvstore-Block-Meta`` header's value: base64url, no padding."""
    return base64.urlsafe_b64encode(meta_json(meta)).decode().rstrip("=")


def encode_put_stream(
    items: Iterable[tuple[str, BufferLike]], metas: Iterable[Mapping[str, Any] | None] | None = None
) -> list[BufferLike]:
    """A batch/put body as a list of parts (the blocks are not copied); join
    them, or send them as they are. With ``metas`` (one per item, None for
    none), KVB2: each item carries its identity."""
    parts: list[BufferLike] = [MAGIC if metas is None else MAGIC_META]
    ids = iter(metas) if metas is not None else None
    for key, data in items:
        meta = None
        if ids is not None:
            m = next(ids)
            meta = meta_json(m) if m is not None else b""
        parts += (put_item_header(key, memoryview(data).nbytes, meta), data)
    parts.append(END)
    return parts


def encode_get_stream(items: Iterable[tuple[str, int, Buffer]]) -> bytes:
    """A whole batch/get answer (for tests and fakes)."""
    parts: list[Buffer] = [MAGIC]
    for key, status, payload in items:
        k = check_key(key).encode("ascii")
        parts += (_U16.pack(len(k)) + k + _STATUS_LEN.pack(status, memoryview(payload).nbytes), payload)
    parts.append(END)
    return b"".join(parts)


async def read_get_items(
    reader: ByteReader, *, max_payload: int | None = None
) -> AsyncIterator[tuple[str, int, bytes]]:
    """Decode a batch/get answer item by item: ``(key, status, payload)``.

    Raises ProtocolError on bad framing or a stream cut before the end marker;
    items yielded before are complete.
    """
    offset = 0

    async def read(n: int, what: str) -> bytes:
        nonlocal offset
        try:
            data = await reader.readexactly(n)
        except asyncio.IncompleteReadError as e:
            raise ProtocolError(
                f"truncated stream: {what} at byte offset {offset}: expected {n} bytes, got {len(e.partial)}"
            ) from None
        offset += n
        return data

    magic = await read(4, "magic")
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r} at byte offset 0: expected {MAGIC!r}")
    index = 0
    while True:
        (key_len,) = _U16.unpack(await read(2, f"item {index}: key length"))
        if key_len == 0:
            try:
                extra = await reader.readexactly(1)
            except asyncio.IncompleteReadError:
                return
            raise ProtocolError(f"unexpected data {extra!r} at byte offset {offset}, after the end marker")
        if key_len > KEY_MAX_LEN:
            raise ProtocolError(f"item {index}: key length {key_len} at byte offset {offset - 2}")
        raw = await read(key_len, f"item {index}: key")
        try:
            key = check_key(raw.decode("ascii"))
        except (UnicodeDecodeError, InvalidKeyError):
            raise ProtocolError(f"item {index}: invalid key {raw!r} at byte offset {offset - key_len}") from None
        status, payload_len = _STATUS_LEN.unpack(await read(_STATUS_LEN.size, f"item {index} ({key}): status"))
        if not 100 <= status <= 599:
            raise ProtocolError(f"item {index} ({key}): status {status} at byte offset {offset - 10}")
        if status == 200 and payload_len == 0:
            raise ProtocolError(f"item {index} ({key}): status 200 with an empty payload")
        if max_payload is not None and payload_len > max_payload:
            raise ProtocolError(f"item {index} ({key}): payload length {payload_len} exceeds {max_payload}")
        payload = await read(payload_len, f"item {index} ({key}): payload")
        yield key, status, payload
        index += 1
