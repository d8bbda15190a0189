"""Golden corrupt segment files: each defect is found, named, and never read as data.

The files under tests/data/corrupt/ come from make_corrupt.py there (see its
docstring for the cases); manifest.json says where every record and defect is.
Each case is a data directory without an index: the test copies it to a
temporary directory and opens a store on it, so the index is rebuilt from the
segments. Segment 1 is sealed (indexed from its footer), segment 2 is open
(scanned record by record).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.format import (
    RECORD_HEADER,
    TRAILER,
    SegmentHeader,
    Trailer,
    checksum,
    decode_footer,
    decode_record_header,
)
from kvstore.engine.store import Store
from kvstore.errors import CorruptionError, FormatError, NotFound, UnknownFlags
from tests.conftest import kv_sample

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "corrupt"
MANIFEST: dict[str, Any] = json.loads((GOLDEN / "manifest.json").read_text())
CASES: dict[str, dict[str, Any]] = MANIFEST["cases"]
TENANT: str = MANIFEST["tenant"]
SEG1, SEG2 = sorted(MANIFEST["segments"])
RECORDS: dict[str, dict[str, Any]] = {
    r["key"]: {**r, "segment": name} for name, seg in MANIFEST["segments"].items() for r in seg["records"]
}
FLAGS_AT, CRC_AT = 6, RECORD_HEADER.size - 4

OpenCase = Callable[..., Awaitable[Store]]


def golden_master() -> MasterKey:
    return MasterKey(bytes.fromhex((GOLDEN / "master.hex").read_text().strip()))


def seg_bytes(case: str, name: str) -> bytes:
    return (GOLDEN / case / "segments" / TENANT / name).read_bytes()


def content(key: str) -> bytes:
    src = RECORDS[key]["source"]
    return kv_sample(src["file"])[src["start"] : src["start"] + src["size"]]


def seg_label(name: str) -> str:
    return f"{TENANT}/{name}"


def differing_bits(a: bytes, b: bytes) -> list[tuple[int, int]]:
    """(byte, bit) positions where equal-length ``a`` and ``b`` differ."""
    assert len(a) == len(b)
    return [
        (i, bit) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y for bit in range(8) if (x ^ y) >> bit & 1
    ]


@pytest.fixture
async def open_case(tmp_path: Path) -> AsyncIterator[OpenCase]:
    opened: list[Store] = []

    async def _open(case: str, patch: Callable[[Path], None] | None = None) -> Store:
        """Copy the golden data dir ``case``, let ``patch`` change it, open a store on it."""
        data_dir = tmp_path / case
        shutil.copytree(GOLDEN / case, data_dir)
        if patch is not None:
            patch(data_dir)
        cfg = StoreConfig.from_env(data_dir, env={}, segment_size="1MiB", frame_size="4KiB")
        store = await Store.open(cfg, golden_master())
        opened.append(store)
        return store

    yield _open
    for s in opened:
        await s.close()


async def check_readable(store: Store, keys: list[str]) -> None:
    for key in keys:
        data = await store.get(TENANT, key)
        assert hashlib.sha256(data).hexdigest() == RECORDS[key]["sha256"], f"{key} read back wrong"
        assert data == content(key)


async def check_not_found(store: Store, key: str) -> None:
    assert not await store.exists(TENANT, key)
    with pytest.raises(NotFound):
        await store.get(TENANT, key)


def others(*keys: str) -> list[str]:
    return sorted(k for k in RECORDS if k not in keys)


# -- the golden files themselves ----------------------------------------------------


def test_golden_files_hold_exactly_the_documented_defects() -> None:
    intact = {name: seg_bytes("intact", name) for name in (SEG1, SEG2)}
    for key, rec in RECORDS.items():
        assert hashlib.sha256(content(key)).hexdigest() == rec["sha256"], f"{key}: source bytes changed"
    for case, info in CASES.items():
        assert json.loads((GOLDEN / case / "registry.json").read_text())["tenants"].keys() == {TENANT}
        assert not (GOLDEN / case / "index").exists(), "golden data dirs have no index: it is rebuilt"
        for name in (SEG1, SEG2):
            if case == "intact" or name != info["segment"]:
                assert seg_bytes(case, name) == intact[name], f"{case}/{name} should be intact"
    bad = seg_bytes("bad_segment_magic", SEG1)
    assert {i for i, _ in differing_bits(bad, intact[SEG1])} <= set(range(8)) and bad[:8] == b"KVSTSEGX"
    for case in ("bad_header_crc", "flipped_payload_bit"):
        info = CASES[case]
        diff = differing_bits(seg_bytes(case, info["segment"]), intact[info["segment"]])
        assert len(diff) == 1 and diff[0][0] == info["byte"], f"{case}: expected one flipped bit"
    torn = CASES["torn_tail"]
    rec = RECORDS[torn["key"]]
    assert intact[SEG2][: torn["cut_at"]] == seg_bytes("torn_tail", SEG2)
    assert rec["offset"] + rec["payload_offset"] < torn["cut_at"] < rec["offset"] + rec["record_len"]
    assert rec["offset"] + rec["record_len"] == len(intact[SEG2]), "the torn record is the last one"
    uf = CASES["unknown_flag"]
    at = uf["offset"]
    changed = {i for i, _ in differing_bits(seg_bytes("unknown_flag", SEG2), intact[SEG2])}
    assert changed <= {at + FLAGS_AT, at + FLAGS_AT + 1, *range(at + CRC_AT, at + CRC_AT + 4)}


async def test_intact_copy_opens_clean_and_reads_back(open_case: OpenCase) -> None:
    store = await open_case("intact")
    r = store.recovery
    assert r.index_rebuilt and r.segments == 2 and r.segments_from_footer == 1
    assert r.records_replayed == len(RECORDS)
    assert not r.corrupt and not r.truncated and not r.entries_dropped
    await check_readable(store, sorted(RECORDS))
    report = await store.verify(deep=True)
    assert report.ok and report.records == len(RECORDS), report.as_dict()


# -- decoding the bytes directly ------------------------------------------------------


def test_segment_header_decode() -> None:
    for sid, name in ((1, SEG1), (2, SEG2)):
        h = SegmentHeader.decode(seg_bytes("intact", name)[:4096], name)
        assert (h.segment_id, h.tenant, h.direct) == (sid, TENANT, False)
    with pytest.raises(FormatError, match=r"bad segment magic b'KVSTSEGX', expected b'KVSTSEG1'") as ei:
        SegmentHeader.decode(seg_bytes("bad_segment_magic", SEG1)[:4096], SEG1)
    assert type(ei.value) is FormatError and ei.value.segment == SEG1 and ei.value.offset == 0
    with pytest.raises(FormatError, match="truncated"):
        SegmentHeader.decode(seg_bytes("intact", SEG1)[:100])


def test_trailer_decode() -> None:
    raw = seg_bytes("intact", SEG1)
    t = Trailer.decode(raw[-TRAILER.size :], SEG1)
    last = MANIFEST["segments"][SEG1]["records"][-1]
    assert t.footer_offset == last["offset"] + last["record_len"]
    assert t.footer_offset + t.footer_len + TRAILER.size == len(raw)
    assert t.entry_count == len(MANIFEST["segments"][SEG1]["records"])
    footer = raw[t.footer_offset : t.footer_offset + t.footer_len]
    assert checksum(footer) == t.footer_checksum
    entries = decode_footer(footer, t.entry_count, SEG1)
    assert [(e.key, e.offset) for e in entries] == [
        (r["key"], r["offset"]) for r in MANIFEST["segments"][SEG1]["records"]
    ]
    # The payload bit flip leaves the sealed segment's trailer and footer valid.
    assert Trailer.decode(seg_bytes("flipped_payload_bit", SEG1)[-TRAILER.size :]) == t
    # The open segment has none; a damaged trailer is refused.
    with pytest.raises(FormatError, match="no segment trailer"):
        Trailer.decode(seg_bytes("intact", SEG2)[-TRAILER.size :], SEG2)
    damaged = bytearray(raw[-TRAILER.size :])
    damaged[12] ^= 0x04
    with pytest.raises(FormatError, match="trailer checksum mismatch"):
        Trailer.decode(damaged, SEG1)
    with pytest.raises(FormatError, match="truncated"):
        Trailer.decode(raw[-TRAILER.size + 1 :], SEG1)


def test_decode_record_header_with_bad_checksum() -> None:
    info = CASES["bad_header_crc"]
    at = info["offset"]
    good = decode_record_header(seg_bytes("intact", SEG2)[at:], SEG2, at)
    assert good.key == info["key"]
    with pytest.raises(FormatError, match="record header checksum mismatch") as ei:
        decode_record_header(seg_bytes("bad_header_crc", SEG2)[at:], SEG2, at)
    assert type(ei.value) is FormatError, "a checksum failure is not reported as unknown flags"
    assert (ei.value.segment, ei.value.offset) == (SEG2, at)


def test_decode_record_header_with_unknown_flag() -> None:
    info = CASES["unknown_flag"]
    at = info["offset"]
    raw = bytearray(seg_bytes("unknown_flag", SEG2)[at : at + RECORDS[info["key"]]["header_len"]])
    # The header checksum is valid: only the flag check can fire.
    (crc,) = struct.unpack_from("<I", raw, CRC_AT)
    zeroed = bytearray(raw)
    struct.pack_into("<I", zeroed, CRC_AT, 0)
    assert zlib.crc32(zeroed) == crc
    with pytest.raises(UnknownFlags, match=f"record has unknown flags 0x{info['flags']:x}") as ei:
        decode_record_header(raw, SEG2, at)
    assert isinstance(ei.value, FormatError) and ei.value.code == "unknown_flags"
    assert (ei.value.segment, ei.value.offset) == (SEG2, at)
    # With the unknown bit cleared (and the crc recomputed) it is the original header.
    struct.pack_into("<H", raw, FLAGS_AT, info["flags"] & ~0x80)
    struct.pack_into("<I", raw, CRC_AT, 0)
    struct.pack_into("<I", raw, CRC_AT, zlib.crc32(raw))
    assert decode_record_header(raw) == decode_record_header(seg_bytes("intact", SEG2)[at:])


def test_decode_record_with_flipped_payload_bit() -> None:
    info = CASES["flipped_payload_bit"]
    rec = RECORDS[info["key"]]
    raw = seg_bytes("flipped_payload_bit", SEG1)[info["offset"] : info["offset"] + rec["record_len"]]
    h = decode_record_header(raw, SEG1, info["offset"])  # the header is intact
    assert h.key == info["key"] and h.sealed and len(h.frames) == 3
    payload = raw[h.payload_offset : h.payload_offset + h.payload_len]
    ok = [
        checksum(payload[o : o + f.stored_len]) == f.checksum for o, f in zip(h.frame_offsets(), h.frames, strict=True)
    ]
    assert ok == [i != info["frame"] for i in range(3)]


def test_decode_torn_last_record() -> None:
    info = CASES["torn_tail"]
    raw = seg_bytes("torn_tail", SEG2)
    h = decode_record_header(raw[info["offset"] :], SEG2, info["offset"])  # cut in its payload
    assert h.key == info["key"]
    assert info["offset"] + h.record_len > len(raw) == info["cut_at"]


# -- opening a store on them ----------------------------------------------------------


async def test_bad_segment_magic_is_reported_and_the_store_opens(open_case: OpenCase, tmp_path: Path) -> None:
    store = await open_case("bad_segment_magic")
    corrupt = store.recovery.corrupt
    assert len(corrupt) == 1, store.recovery.as_dict()
    segment, offset, what = corrupt[0]
    assert (segment, offset) == (seg_label(SEG1), 0) and "bad segment magic" in what
    for key in (r["key"] for r in MANIFEST["segments"][SEG1]["records"]):
        await check_not_found(store, key)  # never indexed from a segment that does not parse
    seg2_keys = [r["key"] for r in MANIFEST["segments"][SEG2]["records"]]
    await check_readable(store, seg2_keys)
    report = await store.verify()
    assert [(s, o) for s, o, _ in report.errors] == [(seg_label(SEG1), 0)]
    assert "bad segment magic" in report.errors[0][2]
    # Writes go on; the damaged segment is reported, never rewritten.
    assert (await store.put(TENANT, "new", b"n" * 5000)).created
    assert await store.get(TENANT, "new") == b"n" * 5000
    assert (tmp_path / "bad_segment_magic" / "segments" / TENANT / SEG1).read_bytes() == seg_bytes(
        "bad_segment_magic", SEG1
    )


async def test_bad_record_header_checksum_mid_segment_is_corruption(open_case: OpenCase) -> None:
    info = CASES["bad_header_crc"]
    store = await open_case("bad_header_crc")
    r = store.recovery
    assert r.corrupt == [(seg_label(SEG2), info["offset"], r.corrupt[0][2])], r.as_dict()
    assert "record header checksum mismatch" in r.corrupt[0][2]
    assert not r.truncated, "valid records follow: this is corruption, not a torn tail"
    await check_not_found(store, info["key"])
    await check_readable(store, others(info["key"]))
    report = await store.verify()
    assert [(s, o) for s, o, _ in report.errors] == [(seg_label(SEG2), info["offset"])]
    assert "checksum" in report.errors[0][2]


async def test_bad_record_header_checksum_in_a_sealed_segment_fails_the_read(open_case: OpenCase) -> None:
    """A sealed segment is indexed from its footer, so a damaged record header is
    found on read (and by verify), not at open."""
    rec = RECORDS["a01"]
    at = rec["offset"] + RECORD_HEADER.size - 12  # created_ns

    def damage(data_dir: Path) -> None:
        path = data_dir / "segments" / TENANT / SEG1
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0x01
        path.write_bytes(raw)

    store = await open_case("intact", damage)
    assert not store.recovery.corrupt and store.recovery.segments_from_footer == 1
    with pytest.raises(FormatError, match="record header checksum mismatch") as ei:
        await store.get(TENANT, "a01")
    assert (ei.value.segment, ei.value.offset) == (seg_label(SEG1), rec["offset"])
    await check_readable(store, others("a01"))
    report = await store.verify()
    assert (seg_label(SEG1), rec["offset"]) in [(s, o) for s, o, _ in report.errors], report.as_dict()


async def test_flipped_payload_bit_raises_corruption_naming_segment_and_offset(open_case: OpenCase) -> None:
    info = CASES["flipped_payload_bit"]
    key, offset, fs = info["key"], info["offset"], MANIFEST["frame_size"]
    store = await open_case("flipped_payload_bit")
    assert not store.recovery.corrupt, "a sealed segment is indexed from its footer; payloads are checked on read"
    assert await store.exists(TENANT, key)
    with pytest.raises(CorruptionError) as ei:
        await store.get(TENANT, key)
    e = ei.value
    assert (e.segment, e.offset) == (seg_label(SEG1), offset)
    assert f"frame {info['frame']} of key '{key}' fails its checksum" in str(e)
    assert f"segment {seg_label(SEG1)}, offset {offset}" in str(e) and e.code == "corruption"
    with pytest.raises(CorruptionError):
        await store.get_range(TENANT, key, fs - 10, fs + 10)  # touches the bad frame
    # Ranges within the good frames still read back right.
    expect = content(key)
    assert await store.get_range(TENANT, key, 0, fs) == expect[:fs]
    assert await store.get_range(TENANT, key, 2 * fs) == expect[2 * fs :]
    await check_readable(store, others(key))
    for deep in (False, True):
        report = await store.verify(deep=deep)
        assert (seg_label(SEG1), offset) in [(s, o) for s, o, _ in report.errors], report.as_dict()
        assert any("fails its checksum" in what for _, o, what in report.errors if o == offset)


async def test_torn_tail_is_truncated_at_open(open_case: OpenCase, tmp_path: Path) -> None:
    info = CASES["torn_tail"]
    store = await open_case("torn_tail")
    r = store.recovery
    assert r.truncated == [(seg_label(SEG2), info["offset"], info["cut_at"] - info["offset"])], r.as_dict()
    assert not r.corrupt and not r.entries_dropped
    seg = tmp_path / "torn_tail" / "segments" / TENANT / SEG2
    assert seg.stat().st_size == info["offset"]
    await check_not_found(store, info["key"])
    await check_readable(store, others(info["key"]))
    assert (await store.verify(deep=True)).ok
    # The segment takes writes again where the torn record began.
    assert (await store.put(TENANT, info["key"], content(info["key"]))).created
    await check_readable(store, [info["key"]])
    assert seg.stat().st_size == info["offset"] + RECORDS[info["key"]]["record_len"]


async def test_unknown_record_flag_is_detected_as_corruption(open_case: OpenCase) -> None:
    info = CASES["unknown_flag"]
    store = await open_case("unknown_flag")
    r = store.recovery
    assert [(s, o) for s, o, _ in r.corrupt] == [(seg_label(SEG2), info["offset"])], r.as_dict()
    assert f"unknown flags 0x{info['flags']:x}" in r.corrupt[0][2]
    assert not r.truncated
    await check_not_found(store, info["key"])
    await check_readable(store, others(info["key"]))
    report = await store.verify()
    assert [(s, o) for s, o, _ in report.errors] == [(seg_label(SEG2), info["offset"])]
    assert "unknown flags" in report.errors[0][2]
