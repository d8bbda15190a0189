"""Read plans against a raw ``os.preadv`` of the same extents (the target:
>= 0.8x, page cache warm and cold), with HTTP GET over the same unix socket
for context.

Starts the daemon (``kvstore serve``, one worker) on a fresh data directory with a unix
socket, loads ``--blocks`` direct blocks of ``--block-size`` (real KV bytes,
repeated), then, on one thread, in ``--batch``-key plans:

* ``plan``: POST /v1/read-plan, preadv of each block into one buffer, each
  frame's xxh3 checked, DELETE of the lease (what ``get_into`` does, batched);
* ``preadv``: the same extents, from the same descriptors, into the same
  buffer: nothing else (the floor);
* ``http``: GET of each block over the same unix socket into the buffer
  (``AsyncClient.get_into`` with read plans off).

Cold runs drop the segment files' pages first (``posix_fadvise DONTNEED``).
Each figure is the median of ``--repeats`` passes.

    python -m kvstore_bench.plan_bench [--blocks 128] [--block-size 2MiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvstore_client import AsyncClient
from kvstore_client.plans import PlanConnection, PlannedBlock

from kvstore.config import parse_size
from kvstore.errors import ConfigError

from .daemon import daemon
from .samples import GEMMA_BF16 as SAMPLE

GB = 1e9


def _median(fn: Callable[[], int], repeats: int, before: Callable[[], None]) -> float:
    """GB/s, the median of ``repeats`` passes of ``fn`` (bytes it moved)."""
    rates = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0) / GB)
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore_bench.plan_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128, help="direct blocks stored and read per pass (default 128)")
    p.add_argument("--block-size", default="2MiB", help="bytes per block (default 2MiB)")
    p.add_argument("--batch", type=int, default=32, help="keys per plan (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="passes per figure; the median is reported (default 5)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    try:
        size = parse_size("--block-size", args.block_size)
    except ConfigError as e:
        p.error(str(e))
    if args.blocks < 1 or args.batch < 1 or args.repeats < 1:
        p.error("--blocks, --batch and --repeats must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="kvstore-plan-bench-", dir="/var/tmp"))
    sock = str(root / "kv.sock")  # root: the unix socket's directory; the daemon has its own
    stack = contextlib.ExitStack()
    try:
        # /readyz, which daemon() waits for, answers once the store is open (the socket exists before).
        token = stack.enter_context(daemon({}, ["--listen", f"unix:{sock}", "--workers", "1"])).token
        sample = SAMPLE.read_bytes()
        data = (sample * (size // len(sample) + 1))[:size]
        keys = [f"b{i:05d}" for i in range(args.blocks)]

        async def load() -> None:
            async with AsyncClient(f"unix:{sock}", token, strict=True, timeout=60) as c:
                for k in keys:
                    await c.put(k, data)

        asyncio.run(load())
        conn = PlanConnection(sock, token, timeout=60)
        buf = bytearray(size)
        batches = [keys[i : i + args.batch] for i in range(0, len(keys), args.batch)]
        plans = [conn.plan(b, lease_s=600) for b in batches]
        extents: list[PlannedBlock] = [blk for pl in plans for blk in pl.blocks.values()]
        assert len(extents) == len(keys), "every block must be planned"
        fds = sorted({e.fd for e in extents})

        def drop_cache() -> None:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def by_plan() -> int:
            n = 0
            for b in batches:
                plan = conn.plan(b)
                for k in b:
                    n += conn.read_into(plan.blocks[k], buf)
                conn.release(plan.lease)
            return n

        def by_preadv() -> int:
            n = 0
            view = memoryview(buf)
            for e in extents:
                got = 0
                while got < e.size:
                    got += os.preadv(e.fd, [view[got : e.size]], e.offset + got)
                n += got
            return n

        def by_http() -> int:
            async def run() -> int:
                n = 0
                async with AsyncClient(f"unix:{sock}", token, strict=True, timeout=60, read_plans=False) as c:
                    for k in keys:
                        n += await c.get_into(k, buf) or 0
                return n

            return asyncio.run(run())

        t0 = time.perf_counter()
        for b in batches:
            conn.release(conn.plan(b).lease)
        plan_ms = (time.perf_counter() - t0) * 1000 / len(batches)
        rows: dict[str, dict[str, float]] = {}
        for cache, before in (("warm", lambda: None), ("cold", drop_cache)):
            if cache == "warm":
                by_preadv()  # bring every page in
            rows[cache] = {
                "preadv": _median(by_preadv, args.repeats, before),
                "plan": _median(by_plan, args.repeats, before),
                "http": _median(by_http, args.repeats, before),
            }
        for pl in plans:
            conn.release(pl.lease)
        conn.close()
    finally:
        stack.close()
        shutil.rmtree(root, ignore_errors=True)
    what = f"{args.blocks} direct blocks of {size} bytes, {args.batch} keys a plan, one thread"
    print(f"{what}; GB/s (median of {args.repeats}); a plan and its release: {plan_ms:.2f} ms")
    print(f"{'cache':<6} {'preadv':>8} {'plan':>8} {'http':>8} {'plan/preadv':>12} {'http/preadv':>12}")
    for cache, r in rows.items():
        print(
            f"{cache:<6} {r['preadv']:8.2f} {r['plan']:8.2f} {r['http']:8.2f} "
            f"{r['plan'] / r['preadv']:11.2f}x {r['http'] / r['preadv']:11.2f}x"
        )
    if args.json:
        doc = {"blocks": args.blocks, "block_size": size, "batch": args.batch, "plan_ms": plan_ms, **rows}
        args.json.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
