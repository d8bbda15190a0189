"""The decoders of bytes from disk and from the wire, fuzzed with hypothesis on
corrupted real segments (tests/data/corrupt/intact, real KV data, sealed
with the golden master key) and on batch streams.

Properties: a decoder either succeeds or raises the error it documents
(:class:`CorruptionError` and its subclasses for segments and records, or
:class:`NewerFormat` where the damage made a version newer than this
release reads: refused, never taken for a torn tail;
:class:`BadFraming` / :class:`BlockTooLarge` for batch streams), never an
IndexError, struct.error, UnicodeDecodeError or a hang; and the read path
returns exactly the bytes that were stored, or raises: never a wrong byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from kvstore_client.wire import batchframe as wire
from kvstore_client.wire import errors as wire_errors

from kvstore.engine.crypto import MasterKey
from kvstore.engine.format import (
    ALIGN,
    FOOTER_ENTRY,
    RECORD_HEADER,
    TRAILER,
    SegmentHeader,
    Trailer,
    checksum,
    decode_footer,
    decode_record_header,
)
from kvstore.engine.index import IndexEntry
from kvstore.engine.reader import decode_into, load
from kvstore.engine.registry import Registry
from kvstore.engine.segment import SegmentFile
from kvstore.errors import BadFraming, BlockTooLarge, CorruptionError, NewerFormat
from kvstore.names import validate_key
from kvstore.transport.batchframe import read_put_items_meta
from tests.conftest import kv_sample
from tests.fuzz.conftest import fuzz

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "corrupt"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text())
TENANT: str = MANIFEST["tenant"]
SEGMENTS = {name: (GOLDEN / "intact" / "segments" / TENANT / name).read_bytes() for name in MANIFEST["segments"]}


def _content(rec: dict[str, Any]) -> bytes:
    src = rec["source"]
    data = kv_sample(src["file"])[src["start"] : src["start"] + src["size"]]
    assert hashlib.sha256(data).hexdigest() == rec["sha256"]
    return data


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Registry, dict[str, IndexEntry]]]:
    """A scratch directory, the golden registry (read-only) and each record's
    index entry, taken from the intact segments."""
    tmp = tmp_path_factory.mktemp("decoders")
    shutil.copy(GOLDEN / "intact" / "registry.json", tmp / "registry.json")
    master = MasterKey(bytes.fromhex((GOLDEN / "master.hex").read_text().strip()))
    registry = Registry(tmp / "registry.json", master, readonly=True)
    entries = {}
    for name, seg in MANIFEST["segments"].items():
        for rec in seg["records"]:
            h = decode_record_header(SEGMENTS[name][rec["offset"] :])
            entries[rec["key"]] = IndexEntry(
                int(name.split(".")[0], 16),
                rec["offset"],
                h.record_len,
                h.payload_offset,
                h.logical_size,
                h.flags,
                h.key_version,
                h.record_id,
                h.created_ns,
            )
    yield tmp, registry, entries


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[str, bytes]:
    """A golden segment with random damage: flipped bits, overwritten or
    zeroed spans, a truncation, a span copied from elsewhere."""
    name = draw(st.sampled_from(sorted(SEGMENTS)))
    data = bytearray(SEGMENTS[name])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "flip", "overwrite", "zero", "copy", "truncate"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "overwrite":
            patch = draw(st.binary(min_size=1, max_size=64))
            data[at : at + len(patch)] = patch
        elif kind == "zero":
            n = draw(st.integers(1, 4096))
            data[at : at + n] = bytes(len(data[at : at + n]))
        elif kind == "copy":
            src = draw(st.integers(0, len(data) - 1))
            n = draw(st.integers(1, 512))
            data[at : at + n] = data[src : src + n]
        else:
            del data[at:]
    return name, bytes(data)


def _expect_corruption(fn: Any, *args: Any) -> Any:
    """fn(*args), or None if it raised CorruptionError or NewerFormat
    (anything else fails the test)."""
    try:
        return fn(*args)
    except (CorruptionError, NewerFormat):
        return None


def test_segment_decoders_on_corrupted_segments(golden: tuple[Path, Registry, dict[str, IndexEntry]]) -> None:
    tmp, registry, entries = golden

    def one(case: tuple[str, bytes]) -> None:
        name, data = case
        _expect_corruption(SegmentHeader.decode, data[:ALIGN])
        if len(data) >= TRAILER.size:
            _expect_corruption(Trailer.decode, data[-TRAILER.size :])
        records = MANIFEST["segments"][name]["records"]
        for rec in records:
            _expect_corruption(decode_record_header, data[rec["offset"] :])
        path = tmp / name
        path.write_bytes(data)
        seg = _expect_corruption(SegmentFile.open, path)
        if seg is None:
            return
        try:
            with contextlib.suppress(NewerFormat):  # a scan stops there: nothing after it is judged
                for item in seg.scan(verify_from=ALIGN):
                    assert (item.header is None) != (item.error is None)
            if seg.sealed:
                _expect_corruption(seg.read_footer)
            for rec in records:
                _read_back(seg, entries[rec["key"]], rec, registry)
        finally:
            seg.close()

    fuzz(one, examples=1000, case=corrupted())


def _read_back(seg: SegmentFile, entry: IndexEntry, rec: dict[str, Any], registry: Registry) -> None:
    """The read path on a damaged segment: the stored bytes, or CorruptionError."""
    size = entry.logical_size
    try:
        loaded = load(seg, entry, TENANT, rec["key"], 0, size, registry)
        out = bytearray(size)
        fs = loaded.header.frame_size
        for i in range(loaded.first, loaded.last + 1):
            lo, hi = i * fs, min((i + 1) * fs, size)
            decode_into(loaded, i, lo, hi, memoryview(out)[lo:hi])
    except (CorruptionError, NewerFormat):
        return
    assert bytes(out) == _content(rec), f"{rec['key']} read back wrong from a damaged segment"


def _record_header_bytes(fields: tuple[Any, ...], tail: bytes) -> bytes:
    raw = bytearray(RECORD_HEADER.pack(*fields) + tail)
    struct.pack_into("<I", raw, RECORD_HEADER.size - 4, 0)
    struct.pack_into("<I", raw, RECORD_HEADER.size - 4, zlib.crc32(raw))
    return bytes(raw)


@st.composite
def record_headers(draw: st.DrawFn) -> bytes:
    """Structure-aware record headers: any field values, a correct crc (so the
    checks behind it are what is exercised), a tail of random bytes."""
    u8, u16, u32, u64 = (st.integers(0, (1 << b) - 1) for b in (8, 16, 32, 64))
    small = st.integers(0, 64)
    tail = draw(st.binary(max_size=300))
    header_len = draw(st.one_of(st.just(RECORD_HEADER.size + len(tail)), u32))
    fields = (
        b"KVR1",
        draw(st.sampled_from([1, 1, 1, 0, 2]) | u8),
        draw(st.sampled_from([1, 2]) | u8),
        draw(st.sampled_from([0, 1, 2, 3]) | u16),
        header_len,
        draw(u32),
        draw(small | u8),
        0,
        draw(small | u16),
        draw(u32),
        draw(st.sampled_from([4096, 65536]) | u32),
        draw(small | u32),
        draw(u64),
        draw(u64),
        draw(st.integers(0, 1 << 20).map(lambda n: n * ALIGN) | u64),
        draw(st.binary(min_size=16, max_size=16)),
        draw(u64),
        0,
    )
    return _record_header_bytes(fields, tail)


def test_record_header_decoder_on_any_fields() -> None:
    def one(raw: bytes) -> None:
        h = _expect_corruption(decode_record_header, raw)
        if h is not None:  # what it accepts is consistent
            assert h.payload_offset >= h.header_len and h.record_len % ALIGN == 0
            assert sum(f.stored_len for f in h.frames) == h.payload_len

    fuzz(one, examples=400, raw=record_headers())


@st.composite
def footers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A footer region of random entries and key bytes, and an entry count."""
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.binary(max_size=20))
        klen = draw(st.just(len(key)) | st.integers(0, 0xFFFF))
        fields = [draw(st.integers(0, (1 << 64) - 1)) for _ in range(4)]
        parts.append(FOOTER_ENTRY.pack(*fields, draw(st.binary(min_size=16, max_size=16)), 0, 0, 0, 1, 0, klen) + key)
    return b"".join(parts) + draw(st.binary(max_size=8)), draw(st.integers(0, 6))


def test_footer_decoder_on_any_bytes(tmp_path: Path) -> None:
    """decode_footer, and a sealed segment whose footer has a valid checksum
    and trailer but any content (a footer written by a bug, or by hand)."""
    intact = SEGMENTS[min(SEGMENTS)]
    trailer = Trailer.decode(intact[-TRAILER.size :])
    path = tmp_path / "s.seg"

    def one(case: tuple[bytes, int]) -> None:
        footer, count = case
        _expect_corruption(decode_footer, footer, count)
        body = intact[: trailer.footer_offset]
        t = Trailer(trailer.footer_offset, len(footer), count, checksum(footer), trailer.sealed_ns)
        path.write_bytes(body + footer + t.encode())
        seg = SegmentFile.open(path)
        try:
            _expect_corruption(seg.read_footer)
        finally:
            seg.close()

    fuzz(one, examples=300, case=footers())


class _Bytes:
    """An in-memory ByteReader over ``data``."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    async def readexactly(self, n: int, /) -> bytes:
        chunk = self._data[self._pos : self._pos + n]
        self._pos += len(chunk)
        if len(chunk) < n:
            raise asyncio.IncompleteReadError(chunk, n)
        return chunk


KEYS = st.from_regex(r"[A-Za-z0-9._~:@=+-]{1,20}", fullmatch=True)


@st.composite
def mutated_streams(draw: st.DrawFn, get: bool) -> bytes:
    if get:
        items = draw(st.lists(st.tuples(KEYS, st.sampled_from([200, 404, 500]), st.binary(min_size=1, max_size=64))))
        data = bytearray(wire.encode_get_stream(items))
    else:
        data = bytearray(wire.encode_put_stream(draw(st.lists(st.tuples(KEYS, st.binary(min_size=1)), max_size=5))))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 12))]
        else:
            del data[at:]
    return bytes(data)


def test_batch_framing_decoders_on_mutated_streams() -> None:
    """The daemon's put decoder (its errors: 400, 413) and the get decoder the client uses."""

    async def decode_put(raw: bytes) -> None:
        async for key, data, _ in read_put_items_meta(_Bytes(raw), max_block_size=1000, max_items=8):
            assert validate_key(key) == key and 1 <= len(data) <= 1000

    async def decode_get(raw: bytes) -> None:
        async for key, status, payload in wire.read_get_items(_Bytes(raw), max_payload=1000):
            assert validate_key(key) == key and 100 <= status <= 599 and len(payload) <= 1000
            assert status != 200 or payload

    def one(put: bytes, get: bytes) -> None:
        with contextlib.suppress(BadFraming, BlockTooLarge):
            asyncio.run(decode_put(put))
        with contextlib.suppress(wire_errors.BadFraming):
            asyncio.run(decode_get(get))

    fuzz(one, examples=300, put=mutated_streams(get=False), get=mutated_streams(get=True))
