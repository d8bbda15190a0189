"""What a removal costs: quota evictions and TTL removals beside deletes.

A benchmark, not a test. Every removal (delete, quota eviction, TTL
removal) writes a tombstone, so that an index rebuild never brings the block
back; evictions once only dropped the index entry. This
measures, on the engine in one process, ``--repeat`` times on a fresh store
each (medians reported):

* **quota**: ``--blocks`` blocks of ``--block-size`` stored, then the
  tenant's quota cut to a tenth: the blocks evicted per second (the cut
  returns once they are gone), the bytes written per block evicted, and the
  CPU seconds per thousand evicted;
* **ttl**: the same blocks with a 1 s TTL, expired: ``expire()`` removes
  them all; blocks per second, bytes written per block;
* **delete**: the same blocks deleted one request at a time (``--concurrency``
  at once), as a client does: blocks per second, bytes written per block.

Run it against another checkout (``PYTHONPATH=/path/to/checkout``) to
compare revisions in the same run. ``--json`` writes every figure.

Run: ``.venv/bin/python -m kvstore_bench.removal_bench --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig, parse_size
from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store

from .harness import cpu_seconds


def _counter(store: Store, name: str) -> float:
    return store.metrics.counter(name)


async def _loaded(root: Path, blocks: int, size: int, **tenant: Any) -> Store:
    cfg = StoreConfig.from_env(root, env={}, segment_size="64MiB", compact_interval_s="0")
    store = await Store.open(cfg, MasterKey(os.urandom(32)))
    await store.create_tenant("t", "direct", **tenant)
    payload = os.urandom(size)
    for i in range(0, blocks, 64):
        await store.put_many("t", [(f"k{j:07d}", payload) for j in range(i, min(blocks, i + 64))])
    return store


async def _measure(kind: str, root: Path, blocks: int, size: int, concurrency: int) -> dict[str, float]:
    store = await _loaded(root, blocks, size, ttl_s=1 if kind == "ttl" else None)
    try:
        written0, cpu0 = _counter(store, "kvstore_bytes_written_total"), cpu_seconds()
        before = (await store.stats("t")).blocks
        if kind == "ttl":
            await asyncio.sleep(1.1)
        t0 = time.perf_counter()
        if kind == "quota":
            await store.set_limits("t", quota_bytes=max(1, blocks * size // 10))
        elif kind == "ttl":
            await store.expire("t")
        else:
            keys = [f"k{j:07d}" for j in range(blocks)]
            sem = asyncio.Semaphore(concurrency)

            async def one(key: str) -> None:
                async with sem:
                    await store.delete("t", key)

            await asyncio.gather(*(one(k) for k in keys))
        seconds = time.perf_counter() - t0
        removed = before - (await store.stats("t")).blocks
        written = _counter(store, "kvstore_bytes_written_total") - written0
        cpu = cpu_seconds() - cpu0
        return {
            "removed": removed,
            "seconds": seconds,
            "blocks_per_s": removed / seconds if seconds else 0.0,
            "bytes_written_per_block": written / removed if removed else 0.0,
            "cpu_s_per_1000": 1000 * cpu / removed if removed else 0.0,
        }
    finally:
        await store.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"blocks": args.blocks, "block_size": args.block_size, "runs": {}}
    for kind in ("quota", "ttl", "delete"):
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                runs.append(await _measure(kind, Path(tmp), args.blocks, args.block_size, args.concurrency))
        out["runs"][kind] = runs
        out[kind] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--blocks", type=int, default=4000, help="blocks stored before each removal (default 4000)")
    p.add_argument("--block-size", type=lambda v: parse_size("--block-size", v), default=64 << 10)
    p.add_argument("--concurrency", type=int, default=32, help="deletes in flight (default 32)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the stores go (default: the system's temporary directory)")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    print(f"{args.blocks} blocks of {args.block_size} bytes, medians of {args.repeat}:")
    for kind in ("quota", "ttl", "delete"):
        m = out[kind]
        print(
            f"  {kind:6s}: {m['removed']:.0f} removed, {m['blocks_per_s']:8.0f} blocks/s, "
            f"{m['bytes_written_per_block']:6.0f} bytes written per block, {m['cpu_s_per_1000']:.3f} CPU-s per 1000"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
