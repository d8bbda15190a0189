"""``kvstore-bench codec``: what each compression a tenant can choose costs and
saves on real KV caches, per core, so every sealed read or write figure can be
stated against its codec's limit.

For each sample (the package's ``data/kv`` by default: real Gemma 3 270M and
MiniLM KV slices, bf16 and fp16), each compression (``none``, ``zstd``,
``zstd-bp2``) and each frame size, on one thread: encode and decode GB/s of
plaintext, and the ratio (plaintext / stored). ``sealed`` adds AES-256-GCM
(seal on encode, open on decode), as a sealed tenant's record pays it; direct
tenants pay only the xxh3 checksum, reported on its own. Each figure is the
median of ``--repeats`` passes over the whole sample.

    kvstore-bench codec [--samples DIR] [--frame-sizes 256KiB,1MiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from kvstore_client.record import RecordMeta, RecordOpener, StoredFrame

from kvstore.config import COMPRESSIONS, Compression, parse_size
from kvstore.engine.codec import decode_frame, encode_frame
from kvstore.engine.crypto import RecordCipher
from kvstore.engine.format import CODEC_NAMES, checksum
from kvstore.errors import ConfigError

from .samples import SAMPLES

GB = 1e9


def _median_seconds(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    data: bytes, compression: Compression, frame_size: int, sealed: bool, level: int, repeats: int
) -> dict[str, Any]:
    """Encode and decode ``data`` frame by frame on this thread."""
    view = memoryview(data)
    frames = [view[i : i + frame_size] for i in range(0, len(view), frame_size)]
    cipher = RecordCipher(os.urandom(32), os.urandom(16), "bench", "key", 1, len(frames), len(data)) if sealed else None
    stored: list[tuple[int, bytes | bytearray | memoryview]] = []

    def encode() -> None:
        stored.clear()
        for i, f in enumerate(frames):
            codec, out = encode_frame(f, compression, level)
            stored.append((codec, cipher.seal(i, out) if cipher is not None else out))

    enc = _median_seconds(encode, repeats)
    outs = [bytearray(len(f)) for f in frames]

    def decode() -> None:
        for i, (codec, s) in enumerate(stored):
            if cipher is not None:
                plain = bytearray(len(s) - 16)
                cipher.open_into(i, memoryview(s), plain)
                decode_frame(codec, memoryview(plain), memoryview(outs[i]))
            else:
                decode_frame(codec, memoryview(s), memoryview(outs[i]))

    dec = _median_seconds(decode, repeats)
    if b"".join(outs) != data:
        raise AssertionError(f"{compression}: the decoded bytes differ from the input")
    stored_bytes = sum(len(s) for _, s in stored)
    return {
        "compression": compression,
        "sealed": sealed,
        "frame_size": frame_size,
        "ratio": len(data) / stored_bytes,
        "encode_gbps": len(data) / enc / GB,
        "decode_gbps": len(data) / dec / GB,
        "client_decode_gbps": len(data) / client_decode_seconds(data, stored, frame_size, cipher, repeats) / GB,
    }


def client_decode_seconds(
    data: bytes,
    stored: list[tuple[int, bytes | bytearray | memoryview]],
    frame_size: int,
    cipher: RecordCipher | None,
    repeats: int,
) -> float:
    """What the client library (kvstore_client.record) takes to check and
    decode the same stored frames, checksum included, on this thread."""
    frames = tuple(StoredFrame(len(s), CODEC_NAMES[codec], xxhash.xxh3_64_intdigest(s)) for codec, s in stored)
    meta = RecordMeta(
        "bench",
        "key",
        len(data),
        0,
        len(data),
        cipher.record_id if cipher else bytes(16),
        1 if cipher else 0,
        frame_size,
        len(frames),
        0,
        frames,
        cipher.frame_key if cipher else None,
    )
    out = bytearray(len(data))
    opener = RecordOpener(meta, memoryview(out))

    def decode() -> None:
        for j, (_, s) in enumerate(stored):
            opener.place(j, s)

    seconds = _median_seconds(decode, repeats)
    if out != data:
        raise AssertionError("the client's decoded bytes differ from the input")
    return seconds


def checksum_gbps(data: bytes, frame_size: int, repeats: int) -> float:
    view = memoryview(data)

    def run() -> None:
        for i in range(0, len(view), frame_size):
            checksum(view[i : i + frame_size])

    return len(data) / _median_seconds(run, repeats) / GB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-bench codec", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--samples", type=Path, default=SAMPLES, help="directory of KV samples (*.bin; default: the ones shipped here)"
    )
    p.add_argument(
        "--frame-sizes", default="256KiB,1MiB", help="frame sizes to encode, comma-separated (default 256KiB,1MiB)"
    )
    p.add_argument("--level", type=int, default=1, help="zstd level (the store's zstd_level; default 1)")
    p.add_argument("--repeats", type=int, default=5, help="passes per figure; the median is reported (default 5)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        frame_sizes = [parse_size("--frame-sizes", s.strip()) for s in args.frame_sizes.split(",")]
    except ConfigError as e:
        p.error(str(e))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    files = sorted(args.samples.glob("*.bin"))
    if not files:
        p.error(f"--samples {args.samples}: no *.bin files")
    rows: list[dict[str, Any]] = []
    print(
        f"{'sample':<36} {'frame':>6} {'compression':<12} {'sealed':<6} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9}"
        f" {'client dec':>10}"
    )
    for f in files:
        data = f.read_bytes()
        for fs in frame_sizes:
            for comp in COMPRESSIONS:
                for sealed in (False, True):
                    r = measure(data, comp, fs, sealed, args.level, args.repeats) | {"sample": f.name}
                    rows.append(r)
                    print(
                        f"{f.name:<36} {fs >> 10:>5}K {comp:<12} {'yes' if sealed else 'no':<6} {r['ratio']:6.3f} "
                        f"{r['encode_gbps']:9.2f} {r['decode_gbps']:9.2f} {r['client_decode_gbps']:10.2f}"
                    )
            xxh = checksum_gbps(data, fs, args.repeats)
            rows.append({"sample": f.name, "frame_size": fs, "checksum_gbps": xxh})
            print(f"{f.name:<36} {fs >> 10:>5}K {'xxh3 checksum (direct reads verify it)':<44} {xxh:9.2f}")
    print("GB/s: 1e9 plaintext bytes per second on one thread (median of --repeats passes). client dec: the")
    print("client library's check (xxh3) and decode of the same stored frames (GET /v1/records, read plans).")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
