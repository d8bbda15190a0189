"""kvstore-bench scale: what grows with blocks and with tenants.

Drives the engine in this process, opened and closed as the daemon opens and
closes it (``Store.open`` / ``close``), on a fresh data directory under
/var/tmp, with the durability operators use (``persistent``; ``--durability``).
Two series:

- **blocks**: one tenant (``--policy``, direct by default) filled in steps
  to each of ``--blocks`` (10k,100k,1M by default; ``--block-bytes`` each).
  At each size: ready after a clean stop (Store.open), the index's size on
  disk, 128-key lookups (p50/p99 of ``--lookups`` on the engine), a TTL
  sweep when nothing expires (wall and CPU seconds), a quota set to 90% of
  what is stored (the call's time, the removals' time, what they removed,
  the process's anonymous memory before and after), and an index rebuilt
  from the segments (its time and size against the index it replaces).
- **tenants**: ``--tenants`` tenants (default 10,000) created one by one
  with ``--tenant-blocks`` blocks each, all sealed every 1,000 tenants (as
  ``seal_after_s`` seals a trickle's: an open segment holds two descriptors
  on the writer); tenant creation's time at the start and at the end, the
  process's open files, and ready after a clean stop with all of them.

Each figure comes with its growth per 10x (the ratio between consecutive
sizes, scaled to a factor of 10), which is what to plan with; the figures
themselves are this machine's.

    kvstore-bench scale --blocks 10000,100000,1000000 --tenants 10000 --json scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HELP = "what grows with blocks (start, lookups, TTL, quota, rebuild) and with tenants (creation, start)"
LOOKUP_KEYS = 128
FILL_BATCH = 256


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-bench scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", default="10000,100000,1000000", help="tenant sizes, comma-separated ('' for none)")
    p.add_argument("--block-bytes", type=int, default=4096, help="bytes of each block (default 4096)")
    p.add_argument("--policy", choices=("direct", "sealed"), default="direct", help="the tenants' policy")
    p.add_argument(
        "--durability", choices=("persistent", "ephemeral"), default="persistent", help="the tenants' durability"
    )
    p.add_argument("--lookups", type=int, default=2000, help="128-key lookups timed at each size")
    p.add_argument("--tenants", type=int, default=10_000, help="tenants of the second series (0: none)")
    p.add_argument("--tenant-blocks", type=int, default=10, help="blocks of each of those tenants")
    p.add_argument("--no-rebuild", action="store_true", help="skip the index rebuild at each size")
    p.add_argument("--dir", type=Path, help="where the data directory goes (default: a new one under /var/tmp)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p


def _anon_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _du(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _growth(rows: list[dict[str, Any]], field: str, by: str) -> float | None:
    """The figure's growth per 10x of ``by``, between the last two rows."""
    if len(rows) < 2 or not rows[-2].get(field) or rows[-1].get(field) is None:
        return None
    ratio = float(rows[-1][field]) / float(rows[-2][field])
    per_10x: float = ratio ** (1 / math.log10(float(rows[-1][by]) / float(rows[-2][by])))
    return round(per_10x, 2)


async def _blocks_series(args: argparse.Namespace, root: Path, sizes: list[int]) -> list[dict[str, Any]]:
    from kvstore.config import StoreConfig
    from kvstore.engine.api import MasterKey, Store

    master = MasterKey(os.urandom(32))
    cfg = StoreConfig.from_env(root / "blocks", env={}, compact_interval_s="0")
    payload = os.urandom(args.block_bytes)
    store = await Store.open(cfg, master)
    await store.create_tenant("t", args.policy, durability=args.durability)
    next_key = 0  # keys are b000000000, b000000001, ...: the quota removes the oldest
    rows: list[dict[str, Any]] = []
    rng = random.Random(1)
    try:
        for size in sizes:
            t0 = time.monotonic()
            added = 0
            while (have := (await store.stats("t")).blocks) < size:
                n = min(FILL_BATCH, size - have)
                await store.put_many("t", [(f"b{next_key + i:09d}", payload) for i in range(n)])
                next_key += n
                added += n
            row: dict[str, Any] = {"blocks": size, "fill_blocks_per_s": round(added / (time.monotonic() - t0))}
            print(f"  {size} blocks stored ({row['fill_blocks_per_s']} blocks/s)", file=sys.stderr)
            await store.close()
            t0 = time.monotonic()
            store = await Store.open(cfg, master)
            row["ready_after_clean_stop_s"] = round(time.monotonic() - t0, 3)
            row["index_bytes"] = _du(cfg.data_dir / "index")
            lat: list[float] = []
            for _ in range(args.lookups):
                first = rng.randrange(0, max(1, next_key - LOOKUP_KEYS))
                keys = [f"b{first + i:09d}" for i in range(LOOKUP_KEYS)]
                t0 = time.perf_counter()
                await store.lookup("t", keys)
                lat.append((time.perf_counter() - t0) * 1000)
            row["lookup128_p50_ms"] = round(statistics.median(lat), 3)
            row["lookup128_p99_ms"] = round(_pct(lat, 0.99), 3)
            # TTL of an hour: nothing expires; the sweep costs what it reads.
            await store.set_limits("t", ttl_s=3600)
            c0, t0 = _cpu_s(), time.monotonic()
            expired = await store.expire("t")
            row["ttl_sweep_nothing_expires_s"] = round(time.monotonic() - t0, 4)
            row["ttl_sweep_cpu_s"] = round(_cpu_s() - c0, 4)
            if expired:
                raise RuntimeError(f"{expired} blocks expired under a TTL of an hour")
            await store.set_limits("t", ttl_s=0)
            # A quota of 90% of what is stored: the call, then its removals (in the background).
            stored = (await store.stats("t")).stored_bytes
            quota = int(stored * 0.9)
            anon0 = _anon_mib()
            c0, t0 = _cpu_s(), time.monotonic()
            answer = await store.set_limits("t", quota_bytes=quota)
            row["quota_call_s"] = round(time.monotonic() - t0, 4)
            await store.quota_enforced("t")
            row["quota_enforced_s"] = round(time.monotonic() - t0, 2)
            row["quota_cpu_s"] = round(_cpu_s() - c0, 2)
            after = await store.stats("t")
            row["quota_over_bytes"] = answer["quota_enforcement"]["over_bytes"]
            row["quota_removed_blocks"] = size - after.blocks
            row["quota_held_of_quota"] = round(after.stored_bytes / quota, 4)
            row["anon_mib_before_after_quota"] = [round(anon0), round(_anon_mib())]
            await store.set_limits("t", quota_bytes=0)
            if not args.no_rebuild:
                await store.close()
                replaced = _du(cfg.data_dir / "index")
                shutil.rmtree(cfg.data_dir / "index")
                t0 = time.monotonic()
                store = await Store.open(cfg, master)
                row["rebuild_s"] = round(time.monotonic() - t0, 2)
                await store.close()
                row["replaced_index_bytes"] = replaced
                row["rebuilt_index_bytes"] = _du(cfg.data_dir / "index")
                row["rebuilt_over_replaced"] = round(row["rebuilt_index_bytes"] / max(1, replaced), 2)
                store = await Store.open(cfg, master)
            rows.append(row)
            print(f"  {json.dumps(row)}", file=sys.stderr)
    finally:
        await store.close()
    return rows


async def _tenants_series(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from kvstore.config import StoreConfig
    from kvstore.engine.api import MasterKey, Store

    master = MasterKey(os.urandom(32))
    cfg = StoreConfig.from_env(root / "tenants", env={}, compact_interval_s="0")
    payload = os.urandom(args.block_bytes)
    store = await Store.open(cfg, master)
    times: list[float] = []
    try:
        t_all = time.monotonic()
        for i in range(args.tenants):
            t0 = time.perf_counter()
            await store.create_tenant(f"t{i:05d}", args.policy, durability=args.durability)
            times.append((time.perf_counter() - t0) * 1000)
            await store.put_many(f"t{i:05d}", [(f"b{j}", payload) for j in range(args.tenant_blocks)])
            if (i + 1) % 1000 == 0:
                # Sealed now and then, as seal_after_s seals a trickle's: each tenant's open
                # segment holds two descriptors on the writer until it is sealed.
                await store.flush()
                print(f"  {i + 1} tenants ({time.monotonic() - t_all:.0f} s)", file=sys.stderr)
        fds_open = len(os.listdir("/proc/self/fd"))
    finally:
        await store.close()
    t0 = time.monotonic()
    store = await Store.open(cfg, master)
    ready = time.monotonic() - t0
    await store.close()
    first, last = times[: min(100, len(times))], times[-min(100, len(times)) :]
    return {
        "tenants": args.tenants,
        "blocks_each": args.tenant_blocks,
        "create_ms_first_100_median": round(statistics.median(first), 2),
        "create_ms_last_100_median": round(statistics.median(last), 2),
        "create_ms_last_100_p99": round(_pct(last, 0.99), 2),
        "open_files_with_all": fds_open,
        "ready_after_clean_stop_s": round(ready, 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",") if x.strip()]
    root = Path(tempfile.mkdtemp(prefix="kvstore-scale-", dir=args.dir or "/var/tmp"))
    out: dict[str, Any] = {"block_bytes": args.block_bytes, "policy": args.policy, "durability": args.durability}
    try:
        if sizes:
            rows = asyncio.run(_blocks_series(args, root, sizes))
            out["blocks"] = rows
            out["growth_per_10x"] = {
                f: _growth(rows, f, "blocks")
                for f in (
                    "ready_after_clean_stop_s",
                    "index_bytes",
                    "lookup128_p99_ms",
                    "ttl_sweep_cpu_s",
                    "quota_enforced_s",
                    "rebuild_s",
                )
            }
            shutil.rmtree(root / "blocks", ignore_errors=True)
        if args.tenants:
            out["tenants"] = asyncio.run(_tenants_series(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0
