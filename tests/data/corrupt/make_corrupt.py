"""Build the golden corrupt data directories used by tests/fault/test_golden_corrupt.py.

Run from the repository root to regenerate (the output is committed; the bytes
change on every run, as record ids, data keys and timestamps are random, and
manifest.json is rewritten to match)::

    .venv/bin/python tests/data/corrupt/make_corrupt.py

It writes a small store (sealed tenant ``t``, 4 KiB frames, 1 MiB segments)
with a sealed segment 1 and an open segment 2, then one data directory per
case below, each a copy of that store (registry.json + segments/t/*.seg, no
index) with one defect:

    intact               no defect
    bad_segment_magic    segment 1's magic is b"KVSTSEGX"
    bad_header_crc       one bit of record b02's created_ns flipped (crc not updated)
    flipped_payload_bit  one bit of frame 1 of record a03 flipped (a sealed segment)
    torn_tail            segment 2 cut in the middle of its last record, b05
    unknown_flag         record b03 has flag bit 0x80 set, its header crc recomputed

master.hex holds the master key; manifest.json every record (key, offset,
lengths, where its bytes come from in bench/data/kv, sha256) and every defect.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import struct
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from kvstore.config import StoreConfig  # noqa: E402
from kvstore.engine.crypto import MasterKey  # noqa: E402
from kvstore.engine.format import RECORD_HEADER  # noqa: E402
from kvstore.engine.segment import SegmentFile, segment_name  # noqa: E402
from kvstore.engine.store import Store  # noqa: E402

MASTER_KEY_HEX = "5a1f3c9e0b7d4e2a8c6f1b3d5e7a9c0e2f4a6b8d0c1e3f5a7b9d2c4e6f8a0b1c"
TENANT = "t"
KV_FILE = "gemma3-270m.bf16.layers8-9.bin"
# (key, size): a03 and b04 span three 4 KiB frames; a04 is a single byte.
SEGMENT_1 = [("a00", 100), ("a01", 3000), ("a02", 4096), ("a03", 9000), ("a04", 1), ("a05", 2500)]
SEGMENT_2 = [("b00", 200), ("b01", 5000), ("b02", 1500), ("b03", 700), ("b04", 12000), ("b05", 3000)]
UNKNOWN_FLAG = 0x80
_FLAGS_AT = 6  # RECORD_HEADER: magic 4s, version B, kind B, flags H
_CREATED_AT = RECORD_HEADER.size - 12  # created_ns u64, then header_crc u32
_CRC_AT = RECORD_HEADER.size - 4


def config(data_dir: Path) -> StoreConfig:
    return StoreConfig.from_env(data_dir, env={}, segment_size="1MiB", frame_size="4KiB")


def source(i: int, size: int) -> dict[str, Any]:
    """Where block ``i``'s bytes come from: a slice of a real KV cache."""
    return {"file": KV_FILE, "start": 1_000_003 * (i + 1) % (3 << 20), "size": size}


async def build(data_dir: Path) -> dict[str, bytes]:
    kv = (ROOT / "bench" / "data" / "kv" / KV_FILE).read_bytes()
    store = await Store.open(config(data_dir), MasterKey(bytes.fromhex(MASTER_KEY_HEX)))
    await store.create_tenant(TENANT, "sealed")
    blocks: dict[str, bytes] = {}
    for i, (key, size) in enumerate(SEGMENT_1 + SEGMENT_2):
        src = source(i, size)
        blocks[key] = kv[src["start"] : src["start"] + size]
        assert (await store.put(TENANT, key, blocks[key])).created
        if i == len(SEGMENT_1) - 1:
            await store.flush()  # seal segment 1; segment 2 stays open
    await store.close()
    return blocks


def describe(path: Path, blocks: dict[str, bytes], first: int) -> dict[str, Any]:
    seg = SegmentFile.open(path)
    try:
        records = []
        for n, item in enumerate(seg.scan()):
            h = item.header
            assert h is not None and item.error is None
            records.append(
                {
                    "key": h.key,
                    "offset": item.offset,
                    "record_len": h.record_len,
                    "header_len": h.header_len,
                    "payload_offset": h.payload_offset,
                    "frames": [f.stored_len for f in h.frames],
                    "source": source(first + n, h.logical_size),
                    "sha256": hashlib.sha256(blocks[h.key]).hexdigest(),
                }
            )
        return {"sealed": seg.sealed, "size": seg.size, "records": records}
    finally:
        seg.close()


def flip_bit(buf: bytearray, pos: int, bit: int) -> None:
    buf[pos] ^= 1 << bit


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        blocks = asyncio.run(build(data))
        seg_dir = data / "segments" / TENANT
        names = [segment_name(1), segment_name(2)]
        assert sorted(p.name for p in seg_dir.iterdir()) == names
        segs = {n: (seg_dir / n).read_bytes() for n in names}
        layout = {
            names[0]: describe(seg_dir / names[0], blocks, 0),
            names[1]: describe(seg_dir / names[1], blocks, len(SEGMENT_1)),
        }
        registry = (data / "registry.json").read_bytes()

    def rec(name: str, key: str) -> dict[str, Any]:
        return next(r for r in layout[name]["records"] if r["key"] == key)

    s1, s2 = names
    cases: dict[str, dict[str, Any]] = {"intact": {}}
    files: dict[str, dict[str, bytes]] = {"intact": dict(segs)}

    b = bytearray(segs[s1])
    b[0:8] = b"KVSTSEGX"
    cases["bad_segment_magic"] = {"segment": s1, "offset": 0}
    files["bad_segment_magic"] = {**segs, s1: bytes(b)}

    r = rec(s2, "b02")
    b = bytearray(segs[s2])
    flip_bit(b, r["offset"] + _CREATED_AT, 0)
    cases["bad_header_crc"] = {"segment": s2, "key": "b02", "offset": r["offset"], "byte": r["offset"] + _CREATED_AT}
    files["bad_header_crc"] = {**segs, s2: bytes(b)}

    r = rec(s1, "a03")
    pos = r["offset"] + r["payload_offset"] + r["frames"][0] + 17  # inside frame 1
    b = bytearray(segs[s1])
    flip_bit(b, pos, 5)
    cases["flipped_payload_bit"] = {"segment": s1, "key": "a03", "offset": r["offset"], "frame": 1, "byte": pos}
    files["flipped_payload_bit"] = {**segs, s1: bytes(b)}

    r = rec(s2, "b05")
    cut = r["offset"] + r["payload_offset"] + sum(r["frames"]) // 2
    cases["torn_tail"] = {"segment": s2, "key": "b05", "offset": r["offset"], "cut_at": cut}
    files["torn_tail"] = {**segs, s2: segs[s2][:cut]}

    r = rec(s2, "b03")
    b = bytearray(segs[s2])
    at = r["offset"]
    (flags,) = struct.unpack_from("<H", b, at + _FLAGS_AT)
    struct.pack_into("<H", b, at + _FLAGS_AT, flags | UNKNOWN_FLAG)
    header = bytearray(b[at : at + r["header_len"]])
    struct.pack_into("<I", header, _CRC_AT, 0)
    struct.pack_into("<I", b, at + _CRC_AT, zlib.crc32(header))
    cases["unknown_flag"] = {"segment": s2, "key": "b03", "offset": at, "flags": flags | UNKNOWN_FLAG}
    files["unknown_flag"] = {**segs, s2: bytes(b)}

    for case, segfiles in files.items():
        out = HERE / case
        shutil.rmtree(out, ignore_errors=True)
        (out / "segments" / TENANT).mkdir(parents=True)
        (out / "registry.json").write_bytes(registry)
        for name, raw in segfiles.items():
            (out / "segments" / TENANT / name).write_bytes(raw)
    (HERE / "master.hex").write_text(MASTER_KEY_HEX + "\n")
    manifest = {"tenant": TENANT, "frame_size": 4096, "segments": layout, "cases": cases}
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {len(files)} cases to {HERE}")


if __name__ == "__main__":
    main()
