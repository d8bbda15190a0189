"""``kvstore-bench run``: the throughput benchmark in an engine's terms, over the client library.

One run, on one data set built from the model geometry:

* block bytes = the KV cache of ``--tokens-per-block`` tokens held by *one*
  tensor-parallel rank (``sizing.tp_shard``): an engine stores one
  kvstore block per engine block per rank, so an engine block is ``--tp``
  kvstore blocks;
* ``--blocks`` distinct keys are loaded first (untimed), their contents cut
  from the real KV-cache samples (the package's ``data/kv``, ``store_bench``'s
  loader): the sample bytes, in 64 KiB chunks, concatenated from a different
  starting chunk for each of up to 16 distinct contents, reused round-robin;
* then ``--concurrency`` workers each loop for ``--duration`` seconds (or
  until ``--ops`` operations in all): with probability ``--read-ratio`` a read
  (with probability ``--hit-ratio`` of a loaded key, else of a key never
  written: a miss), else a write of a loaded block's bytes to a new key.

Every key this run stores starts with ``bench-<run id>-``. Against an existing
daemon (``--endpoint``) they are all deleted at the end (found by listing the
tenant's keys with that prefix), unless ``--keep``; a daemon started here is
removed whole, data directory and all.

kvstore is driven by ``kvstore_client.AsyncClient(strict=True)``, so every
failure is an exception the benchmark counts by kind (nothing is hidden as a
miss); reads go through ``get_into`` into a per-worker buffer and are compared
with the bytes put. The peers, when installed, run the same workload on the
same bytes right after: Redis (``redis-server``, no persistence, through
``redis.asyncio``) and nginx serving the blocks as files (reads only).

Figures: GB/s = 1e9 bytes of block bodies moved by successful reads (hits)
and writes / elapsed seconds; blocks/s = hits + writes per second;
tokens/s retrievable = hit blocks/s x tokens per block / TP size (an engine
block needs one kvstore block from each of the TP ranks).
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kvstore_client import AsyncClient
from kvstore_client.errors import KVStoreClientError, ServerError

from .cli import RUN_BLOCKS, RUN_BLOCKS_ENDPOINT, RUN_BLOCKS_SHORT
from .daemon import Kvstore
from .harness import Processes, free_port, percentile_or_none, sigterm_as_exit
from .http_bench import DataSet, Nginx
from .models import ModelGeometry
from .plots import matplotlib_missing, save_png
from .samples import SAMPLES
from .sizing import fmt_bytes, kv_bytes_per_token, tp_shard
from .store_bench import GB, MEMORY_FS, default_base_dir, load_samples, mount_of
from .ttft import break_even, ttft_row

PROG = "kvstore-bench run"
PEERS = ("redis", "nginx")
INSTALL_HINT = "apt-get install -y redis-server nginx"
REDIS_SERVER = "redis-server"
CHUNK = 64 * 1024
MAX_DISTINCT = 16
DAEMON_MAX_BLOCK = 64 * 1024 * 1024  # the daemon's default max_block_size
OPS = ("get", "get_miss", "put")
FORMULAS = {
    "gbps": "1e9 bytes of block bodies of successful reads (hits) and writes / elapsed seconds",
    "blocks_per_s": "(read hits + writes) / elapsed seconds",
    "tokens_per_s": "read hits per second x tokens_per_block / tp (one engine block = tp kvstore blocks)",
    "latency": "per operation, from the call to the whole body read (client side, same process as the load)",
    "ttft_load_s": "context x bytes_per_token_per_rank x tp / (read GB/s x 1e9); latency term 0",
}


# -- options -----------------------------------------------------------------------


@dataclass(slots=True)
class RunOptions:
    model: ModelGeometry
    tokens_per_block: int
    tp: int
    block_bytes: int
    blocks: int
    concurrency: int
    duration: float | None
    ops: int | None
    read_ratio: float
    hit_ratio: float
    endpoint: str | None
    token: str | None
    keep: bool
    policy: str
    peers: list[str]
    peers_explicit: bool
    context: int
    prefill_tps: float | None
    timeout: float
    short: bool
    progress: bool
    json_path: Path | None
    png_path: Path | None
    seed: int


def build_options(args: argparse.Namespace, error: Callable[[str], Any]) -> RunOptions:
    """Check and complete the parsed options; ``error`` (parser.error) exits 2."""
    model: ModelGeometry = args.model
    if args.dtype:
        model = model.with_dtype(args.dtype)
    short: bool = args.short
    tpb = args.tokens_per_block if args.tokens_per_block is not None else (16 if short else 256)
    try:
        shard = tp_shard(model, args.tp)
    except ValueError as e:
        error(f"argument --tp: {e}")
    block_bytes = shard.bytes_per_token_per_rank * tpb
    if block_bytes > 1024 * 1024 * 1024:
        error(f"argument --tokens-per-block: a block of {fmt_bytes(block_bytes)} is over 1 GiB; use fewer tokens")
    for opt, value in (("--read-ratio", args.read_ratio), ("--hit-ratio", args.hit_ratio)):
        if not 0.0 <= value <= 1.0:
            error(f"argument {opt}: {value:g} must be between 0 and 1")
    if args.duration is not None and args.ops is not None:
        error("argument --ops: not allowed with --duration (one or the other)")
    if args.endpoint is None:
        if args.token is not None:
            error("argument --token: only with --endpoint")
        if args.keep:
            error("argument --keep: only with --endpoint (a daemon started here is removed whole)")
    else:
        if not args.endpoint.startswith(("http://", "https://")):
            error(f"argument --endpoint: {args.endpoint!r} is not an http:// or https:// URL")
        if not (args.token or os.environ.get("KVSTORE_TOKEN")):
            error("argument --token: required with --endpoint (or set KVSTORE_TOKEN)")
        if args.policy is not None:
            error("argument --policy: only for a daemon this benchmark starts (not with --endpoint)")
    peers_explicit = args.peers is not None
    peers: list[str] = []
    if peers_explicit:
        names = [x.strip().lower() for x in args.peers.split(",") if x.strip()]
        bad = [x for x in names if x not in (*PEERS, "none")]
        if bad or not names:
            error(f"argument --peers: {args.peers!r}: expected a comma-separated subset of redis,nginx, or none")
        peers = [p for p in PEERS if p in names]
    elif not short:
        peers = list(PEERS)
    duration: float | None = args.duration
    if duration is None and args.ops is None:
        duration = 2.0 if short else 20.0
    if args.blocks is not None:
        blocks = args.blocks
    elif short:
        blocks = RUN_BLOCKS_SHORT
    else:
        blocks = RUN_BLOCKS if args.endpoint is None else RUN_BLOCKS_ENDPOINT
    if args.png is not None and (why := matplotlib_missing()) is not None:
        error(f"argument --png: {why}")  # now, not after the measurement
    return RunOptions(
        model=model,
        tokens_per_block=tpb,
        tp=args.tp,
        block_bytes=block_bytes,
        blocks=blocks,
        concurrency=args.concurrency if args.concurrency is not None else (4 if short else 8),
        duration=duration,
        ops=args.ops,
        read_ratio=args.read_ratio,
        hit_ratio=args.hit_ratio,
        endpoint=args.endpoint,
        token=args.token or os.environ.get("KVSTORE_TOKEN"),
        keep=args.keep,
        policy=args.policy or "sealed",
        peers=peers,
        peers_explicit=peers_explicit,
        context=args.context,
        prefill_tps=args.prefill_tps,
        timeout=args.timeout,
        short=short,
        progress=not args.no_progress and sys.stderr.isatty(),
        json_path=args.json,
        png_path=args.png,
        seed=args.seed,
    )


# -- data ----------------------------------------------------------------------------


@dataclass(slots=True)
class Blocks:
    keys: list[str]  # the loaded keys; key i holds distinct[i % len(distinct)]
    distinct: list[bytes]
    sources: dict[str, int]
    run_id: str

    def block(self, i: int) -> bytes:
        return self.distinct[i % len(self.distinct)]


def make_blocks(opts: RunOptions, samples: Path = SAMPLES) -> Blocks:
    """Up to MAX_DISTINCT blocks of ``block_bytes``, each the sample chunks concatenated
    from a different starting chunk (and cut to size)."""
    sets = load_samples(samples, CHUNK, ("bf16", "fp16"))
    chunks = [c for d in ("bf16", "fp16") for c in sets[d].blocks]
    if not chunks:
        raise ValueError(f"no KV sample of at least {CHUNK} bytes in {samples}")
    sources = {f: n for s in sets.values() for f, n in s.files.items()}
    n_distinct = min(opts.blocks, MAX_DISTINCT)
    per_block = -(-opts.block_bytes // CHUNK)
    distinct: list[bytes] = []
    for d in range(n_distinct):
        start = d * max(1, len(chunks) // n_distinct) + d
        parts = [chunks[(start + j) % len(chunks)] for j in range(per_block)]
        distinct.append(b"".join(parts)[: opts.block_bytes])
    run_id = os.urandom(4).hex()
    keys = [f"{key_prefix(run_id)}{i:06d}" for i in range(opts.blocks)]
    return Blocks(keys, distinct, sources, run_id)


def key_prefix(run_id: str) -> str:
    """What every key a run stores starts with: its loaded blocks and its writes."""
    return f"bench-{run_id}-"


# -- measurement ---------------------------------------------------------------------------


@dataclass(slots=True)
class Recorder:
    """Every operation's end time, kind and latency; errors by kind."""

    t0: float = 0.0
    events: list[tuple[float, str, float, int]] = field(default_factory=list)  # (t_end, op, latency_s, bytes)
    errors: dict[str, int] = field(default_factory=dict)
    ops_done: int = 0
    bytes_done: int = 0

    def ok(self, op: str, start: float, nbytes: int) -> None:
        now = time.perf_counter()
        self.events.append((now - self.t0, op, now - start, nbytes))
        self.ops_done += 1
        self.bytes_done += nbytes

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.ops_done += 1


def error_kind(e: BaseException) -> str:
    if isinstance(e, ServerError):
        return f"ServerError {e.status} {e.code}".strip()
    if isinstance(e, KVStoreClientError):
        return type(e).__name__
    return f"{type(e).__name__}"


def latency_stats(values: list[float]) -> dict[str, float | int | None]:
    v = sorted(values)
    ms = [x * 1e3 for x in v]
    return {
        "count": len(v),
        "p50_ms": percentile_or_none(ms, 0.5),
        "p90_ms": percentile_or_none(ms, 0.9),
        "p99_ms": percentile_or_none(ms, 0.99),
        "mean_ms": sum(ms) / len(ms) if ms else None,
    }


class Progress:
    """A one-line text bar on stderr, redrawn ~5 times a second."""

    def __init__(self, label: str, rec: Recorder, duration: float | None, ops: int | None, enabled: bool) -> None:
        self.label, self.rec, self.duration, self.ops, self.enabled = label, rec, duration, ops, enabled

    def draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.rec.t0
        if self.ops is not None:
            frac = self.rec.ops_done / self.ops
            where = f"{self.rec.ops_done}/{self.ops} ops"
        else:
            assert self.duration is not None
            frac = elapsed / self.duration
            where = f"{min(elapsed, self.duration):.1f}/{self.duration:g}s"
        frac = 1.0 if final else max(0.0, min(1.0, frac))
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        gbps = self.rec.bytes_done / elapsed / GB if elapsed > 0 else 0.0
        errs = sum(self.rec.errors.values())
        line = f"\r{self.label:<8} [{bar}] {frac * 100:5.1f}% {where}  {gbps:6.2f} GB/s  errors {errs}"
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.draw()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):  # not wait_for: on 3.11 it can swallow a cancellation
                    await stop.wait()
        self.draw(final=True)


class Target(abc.ABC):
    """One system under test: load the blocks, then get/put single blocks."""

    name = ""
    writes = True

    async def open(self) -> None:  # noqa: B027 - optional hook: most targets need no set-up
        """Connect; the default needs nothing."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``."""

    @abc.abstractmethod
    async def get_into(self, key: str, buf: bytearray) -> int | None:
        """Bytes read into ``buf``, None when absent."""

    async def preload(self, blocks: Blocks, concurrency: int) -> None:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await self.put(blocks.keys[i], blocks.block(i))

        await asyncio.gather(*(one(i) for i in range(len(blocks.keys))))


class KvstoreTarget(Target):
    name = "kvstore"

    def __init__(self, endpoint: str, token: str, timeout: float, concurrency: int) -> None:
        self.endpoint, self.token, self.timeout, self.concurrency = endpoint, token, timeout, concurrency
        self.client: AsyncClient | None = None

    async def open(self) -> None:
        self.client = AsyncClient(
            self.endpoint, self.token, timeout=self.timeout, strict=True, pool_size=max(64, 2 * self.concurrency)
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def put(self, key: str, data: bytes) -> None:
        assert self.client is not None
        if not await self.client.put(key, data):
            raise RuntimeError(f"put {key}: not stored")

    async def get_into(self, key: str, buf: bytearray) -> int | None:
        assert self.client is not None
        return await self.client.get_into(key, buf)


class RedisTarget(Target):
    name = "redis"

    def __init__(self, port: int, concurrency: int) -> None:
        self.port, self.concurrency = port, concurrency
        self.conn: Any = None

    async def open(self) -> None:
        import redis.asyncio as aioredis

        self.conn = aioredis.Redis(host="127.0.0.1", port=self.port, max_connections=self.concurrency + 4)

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.aclose()

    async def put(self, key: str, data: bytes) -> None:
        await self.conn.set(key, data)

    async def get_into(self, key: str, buf: bytearray) -> int | None:
        data = await self.conn.get(key)
        if data is None:
            return None
        n = len(data)
        if n > len(buf):
            raise ValueError(f"{key}: {n} bytes, over the buffer")
        buf[:n] = data
        return n


class NginxTarget(Target):
    name = "nginx"
    writes = False

    def __init__(self, port: int, concurrency: int, timeout: float) -> None:
        self.port, self.concurrency, self.timeout = port, concurrency, timeout
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self.session = aiohttp.ClientSession(
            base_url=f"http://127.0.0.1:{self.port}",
            connector=aiohttp.TCPConnector(limit=self.concurrency + 4),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def preload(self, blocks: Blocks, concurrency: int) -> None:
        pass  # the files are written before nginx starts

    async def put(self, key: str, data: bytes) -> None:
        raise TypeError("nginx serves static files: the benchmark does not write to it")

    async def get_into(self, key: str, buf: bytearray) -> int | None:
        assert self.session is not None
        async with self.session.get(f"/blk/{key}") as r:
            if r.status == 404:
                return None
            if r.status != 200:
                raise RuntimeError(f"nginx HTTP {r.status}")
            n = 0
            mv = memoryview(buf)
            async for chunk in r.content.iter_any():
                mv[n : n + len(chunk)] = chunk
                n += len(chunk)
            return n


async def drive(target: Target, blocks: Blocks, opts: RunOptions) -> tuple[Recorder, float]:
    """The timed phase: ``concurrency`` workers until the duration or the op count is reached."""
    rec = Recorder()
    read_ratio = opts.read_ratio if target.writes else 1.0
    counter = iter(range(1 << 62))
    issued = 0
    stop = asyncio.Event()

    async def worker(w: int) -> None:
        nonlocal issued
        rng = random.Random(opts.seed * 1000 + w)
        buf = bytearray(opts.block_bytes)
        while not stop.is_set():
            if opts.ops is not None:
                if issued >= opts.ops:
                    return
                issued += 1
            elif time.perf_counter() - rec.t0 >= (opts.duration or 0.0):
                return
            start = time.perf_counter()
            try:
                if rng.random() < read_ratio:
                    if rng.random() < opts.hit_ratio:
                        i = rng.randrange(len(blocks.keys))
                        n = await target.get_into(blocks.keys[i], buf)
                        if n is None:
                            rec.error("unexpected miss")
                        elif n != opts.block_bytes or buf != blocks.block(i):
                            rec.error("wrong bytes")
                        else:
                            rec.ok("get", start, n)
                    else:
                        key = f"absent-{blocks.run_id}-{next(counter)}"
                        n = await target.get_into(key, buf)
                        if n is None:
                            rec.ok("get_miss", start, 0)
                        else:
                            rec.error("unexpected hit")
                else:
                    i = rng.randrange(len(blocks.keys))
                    await target.put(f"{key_prefix(blocks.run_id)}w{w}-{next(counter)}", blocks.block(i))
                    rec.ok("put", start, opts.block_bytes)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - counted by kind, the run goes on
                rec.error(error_kind(e))

    progress = Progress(target.name, rec, opts.duration, opts.ops, opts.progress)
    rec.t0 = time.perf_counter()
    bar = asyncio.create_task(progress.loop(stop))
    try:
        await asyncio.gather(*(worker(w) for w in range(opts.concurrency)))
    finally:
        stop.set()
        await bar
    return rec, time.perf_counter() - rec.t0


def summarize(rec: Recorder, elapsed: float, opts: RunOptions, reads_only: bool) -> dict[str, Any]:
    by_op: dict[str, list[float]] = {op: [] for op in OPS}
    nbytes = {op: 0 for op in OPS}
    for _, op, lat, n in rec.events:
        by_op[op].append(lat)
        nbytes[op] += n
    hits, misses, puts = len(by_op["get"]), len(by_op["get_miss"]), len(by_op["put"])
    el = max(elapsed, 1e-9)
    read_bps, write_bps = nbytes["get"] / el, nbytes["put"] / el
    series: list[dict[str, Any]] = []
    seconds = max(1, int(elapsed))  # a tail under a second (ops in flight at the end) joins the last second
    buckets: list[list[tuple[str, float, int]]] = [[] for _ in range(seconds)]
    for t, op, lat, n in rec.events:
        buckets[min(seconds - 1, int(t))].append((op, lat, n))
    for s, b in enumerate(buckets):
        span = elapsed - s if s == seconds - 1 else 1.0
        span = max(span, 1e-9)
        data_lat = sorted(lat * 1e3 for op, lat, _ in b if op != "get_miss")
        get_lat = sorted(lat * 1e3 for op, lat, _ in b if op == "get")
        put_lat = sorted(lat * 1e3 for op, lat, _ in b if op == "put")
        series.append(
            {
                "t_s": s + 1,
                "span_s": span,
                "ops_per_s": len(b) / span,
                "gbps": sum(n for _, _, n in b) / span / GB,
                "blocks_per_s": sum(1 for op, _, _ in b if op != "get_miss") / span,
                "p50_ms": percentile_or_none(data_lat, 0.5),
                "p99_ms": percentile_or_none(data_lat, 0.99),
                "get_p50_ms": percentile_or_none(get_lat, 0.5),
                "get_p99_ms": percentile_or_none(get_lat, 0.99),
                "put_p50_ms": percentile_or_none(put_lat, 0.5),
                "put_p99_ms": percentile_or_none(put_lat, 0.99),
            }
        )
    return {
        "elapsed_s": elapsed,
        "reads_only": reads_only,
        "ops": rec.ops_done,
        "ops_per_s": rec.ops_done / el,
        "gbps": (read_bps + write_bps) / GB,
        "read_gbps": read_bps / GB,
        "write_gbps": write_bps / GB,
        "blocks_per_s": (hits + puts) / el,
        "read_blocks_per_s": hits / el,
        "write_blocks_per_s": puts / el,
        "tokens_per_s": hits / el * opts.tokens_per_block / opts.tp,
        "hits": hits,
        "misses": misses,
        "writes": puts,
        "errors": dict(sorted(rec.errors.items())),
        "error_count": sum(rec.errors.values()),
        "latency": {op: latency_stats(by_op[op]) for op in OPS},
        "timeseries": series,
    }


# -- servers -------------------------------------------------------------------------------


def start_redis(procs: Processes, root: Path) -> int:
    exe = shutil.which(REDIS_SERVER)
    assert exe is not None
    port = free_port()
    d = root / "redis"
    d.mkdir()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
    cmd += ["--proto-max-bulk-len", str(max(512 * 1024 * 1024, 2 * DAEMON_MAX_BLOCK)), "--protected-mode", "no"]
    proc = procs.spawn(cmd, d / "redis.log")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}: {(d / 'redis.log').read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return port
        time.sleep(0.05)
    raise RuntimeError("redis-server did not listen within 20 s")


def mem_available() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


# -- report ----------------------------------------------------------------------------------


def fmt_ms(v: float | int | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def render(doc: dict[str, Any]) -> str:
    w = doc["workload"]
    out = [
        f"model {w['model']['name']}, {w['tokens_per_block']} tokens/block, tp={w['tp']}: "
        f"block = {fmt_bytes(w['block_bytes'])} (one rank's share), {w['blocks']} blocks loaded "
        f"({fmt_bytes(w['block_bytes'] * w['blocks']).split(' = ')[-1]})",
        f"mix: {w['read_ratio']:.0%} reads ({w['hit_ratio']:.0%} of them hits), concurrency {w['concurrency']}, "
        + (f"{w['duration_s']:g} s" if w["duration_s"] is not None else f"{w['ops']} ops"),
        "",
    ]
    head = f"{'':<9}{'GB/s':>8}{'read':>8}{'write':>8}{'blocks/s':>10}{'tokens/s':>12}"
    head += f"{'get p50/p90/p99 ms':>22}{'put p50/p90/p99 ms':>22}{'miss p50 ms':>12}"
    head += f"{'hits':>8}{'misses':>8}{'errors':>8}"
    out.append(head)
    for name, r in doc["results"].items():
        g, p, m = r["latency"]["get"], r["latency"]["put"], r["latency"]["get_miss"]
        gl = f"{fmt_ms(g['p50_ms'])}/{fmt_ms(g['p90_ms'])}/{fmt_ms(g['p99_ms'])}"
        pl = f"{fmt_ms(p['p50_ms'])}/{fmt_ms(p['p90_ms'])}/{fmt_ms(p['p99_ms'])}"
        if r["reads_only"]:
            pl = "(no writes)"
        out.append(
            f"{name:<9}{r['gbps']:>8.3f}{r['read_gbps']:>8.3f}{r['write_gbps']:>8.3f}{r['blocks_per_s']:>10.1f}"
            f"{r['tokens_per_s']:>12,.0f}{gl:>22}{pl:>22}{fmt_ms(m['p50_ms']):>12}{r['hits']:>8}{r['misses']:>8}"
            f"{r['error_count']:>8}"
        )
    for name, r in doc["results"].items():
        if r["errors"]:
            out.append(f"{name} errors: " + ", ".join(f"{k}: {v}" for k, v in r["errors"].items()))
    for name, ratios in doc["ratios"].items():
        parts = [f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None]
        out.append(f"kvstore/{name}: " + (", ".join(parts) if parts else "-"))
    for note in doc["notes"]:
        out.append(f"note: {note}")
    t = doc["ttft"]
    if t is not None:
        out.append(t["text"])
    out.append(f"tokens/s = {FORMULAS['tokens_per_s']}; GB/s = {FORMULAS['gbps']}")
    return "\n".join(out)


def ttft_doc(opts: RunOptions, read_gbps: float) -> dict[str, Any] | None:
    if read_gbps <= 0:
        return None
    shard = tp_shard(opts.model, opts.tp)
    bpt = shard.bytes_per_token_all_ranks
    load = opts.context * bpt / (read_gbps * GB)
    doc: dict[str, Any] = {
        "context_tokens": opts.context,
        "bytes_per_token_all_ranks": bpt,
        "bytes_per_token_model": kv_bytes_per_token(opts.model),
        "throughput_gbps": read_gbps,
        "load_s": load,
        "prefill_tps": opts.prefill_tps,
        "recompute_s": None,
        "speedup": None,
        "break_even": None,
    }
    text = (
        f"TTFT model: loading {opts.context:,} tokens ({fmt_bytes(opts.context * bpt).split(' = ')[-1]}) "
        f"at {read_gbps:.3f} GB/s takes {load * 1e3:,.1f} ms"
    )
    if opts.prefill_tps is not None:
        row = ttft_row(opts.context, bpt, read_gbps, opts.prefill_tps)
        be = break_even(bpt, read_gbps, opts.prefill_tps)
        doc.update(
            recompute_s=row.recompute_s,
            speedup=row.speedup if math.isfinite(row.speedup) else None,
            break_even=be.describe(),
        )
        text += (
            f"; recompute at {opts.prefill_tps:,.0f} tokens/s {row.recompute_s * 1e3:,.1f} ms "
            f"({row.speedup:.2f}x, {row.winner} faster; {be.describe()})"
        )
    else:
        text += " (give --prefill-tps for the recompute side)"
    doc["text"] = text
    return doc


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def write_png(path: Path, doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name, r in doc["results"].items():
        ts = r["timeseries"]
        x = [p["t_s"] for p in ts]
        (line,) = ax1.plot(x, [p["gbps"] for p in ts], marker="o", label=f"{name}")
        for key, style in (("p50_ms", "-"), ("p99_ms", "--")):
            y = [p[key] if p[key] is not None else float("nan") for p in ts]
            ax2.plot(x, y, style, color=line.get_color(), marker=".", label=f"{name} {key[:3]}")
    w = doc["workload"]
    ax1.set_title(
        f"kvstore-bench run: {w['model']['name']}, {w['tokens_per_block']} tok/block, tp={w['tp']}, "
        f"{w['read_ratio']:.0%} reads, c={w['concurrency']}"
    )
    ax1.set_ylabel("throughput (GB/s)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("latency, gets+puts (ms)")
    ax2.set_xlabel("second of the run")
    ax2.legend(fontsize="small")
    ax2.grid(alpha=0.3)
    save_png(fig, path)


# -- main --------------------------------------------------------------------------------------


async def measure(target: Target, blocks: Blocks, opts: RunOptions) -> dict[str, Any]:
    await target.open()
    try:
        t0 = time.perf_counter()
        await target.preload(blocks, min(opts.concurrency, 8))
        load_s = time.perf_counter() - t0
        rec, elapsed = await drive(target, blocks, opts)
    finally:
        await target.close()
    res = summarize(rec, elapsed, opts, reads_only=not target.writes)
    res["preload_s"] = load_s
    return res


async def run_keys(client: AsyncClient, run_id: str, endpoint: str | None = None) -> list[str]:
    """Every key of the run ``run_id`` in the client's tenant on one daemon,
    ``endpoint`` (default the client's first): those listed with the run's
    prefix, page by page."""
    prefix = key_prefix(run_id)
    keys: list[str] = []
    after: str | None = None
    while True:
        page, after = await client.list_keys(prefix=prefix, start_after=after, endpoint=endpoint)
        keys += [k for k, _ in page]
        if after is None:
            return keys


async def members(client: AsyncClient) -> list[str]:
    """The daemons that hold the client's keys: a fleet client's members (its
    membership read now if due; :class:`RuntimeError` when no seed ever
    answered ``GET /v1/fleet``), else the client's endpoints."""
    if client.fleet_version is None:
        return client.endpoints
    await client.members()
    if (client.fleet_version or 0) < 0:
        raise RuntimeError("no seed answered GET /v1/fleet: the fleet's members are unknown")
    return client.endpoints


async def held_keys(client: AsyncClient, run_id: str) -> dict[str, list[str]]:
    """The run's keys on each daemon of the client (:func:`members`: every
    member of a fleet), listed one daemon after another."""
    return {url: await run_keys(client, run_id, url) for url in await members(client)}


async def remove_run_blocks(
    endpoints: Sequence[str], token: str, run_id: str, timeout: float, concurrency: int, fleet: bool = False
) -> int:
    """Delete every block the run ``run_id`` stored in the tenant of ``token`` (its
    loaded blocks and its writes, those a timed-out put left there included)
    on every daemon: ``endpoints``, or with ``fleet`` every member of the fleet
    they seed. On each daemon, the keys listed there with the run's prefix are
    deleted there (a key a fleet placed on another member than its owner now
    included), ``concurrency`` deletes at a time. Returns how many were deleted."""
    async with AsyncClient(list(endpoints), token, timeout=timeout, strict=True, fleet=fleet) as client:
        urls = await members(client)
    return sum([await _remove_on(url, token, run_id, timeout, concurrency) for url in urls])


async def _remove_on(url: str, token: str, run_id: str, timeout: float, concurrency: int) -> int:
    """The run's keys listed on the daemon ``url``, deleted there."""
    async with AsyncClient(url, token, timeout=timeout, strict=True) as client:
        keys = await run_keys(client, run_id)
        sem = asyncio.Semaphore(concurrency)

        async def one(key: str) -> bool:
            async with sem:
                return await client.delete(key)

        return sum(await asyncio.gather(*(one(k) for k in keys)))


@dataclass(frozen=True, slots=True)
class Leftovers:
    """What a run against existing daemons (``--endpoint``) stored there, and
    what to do with it at the end: the keys of ``run_id``, kept or deleted.
    ``endpoints``: one daemon, or with ``fleet`` the seeds of a fleet (every
    member is cleaned)."""

    endpoints: tuple[str, ...]
    token: str
    run_id: str
    keep: bool
    timeout: float
    concurrency: int
    fleet: bool = False

    @property
    def where(self) -> str:
        if self.fleet:
            return f"the fleet of {', '.join(self.endpoints)}"
        return f"existing daemon {', '.join(self.endpoints)}"


def clean_endpoint(left: Leftovers, prog: str = PROG) -> str | None:
    """What the run left in an existing daemon's tenant (every member's, for a
    fleet): removed unless ``--keep``. A note for the report, or None when
    removing failed (said on stderr, after ``prog``, with the keys' prefix to
    delete by hand)."""
    prefix = key_prefix(left.run_id)
    if left.keep:
        return f"{left.where}: the run's blocks stay in the tenant (--keep), keys {prefix}*"
    try:
        removed = asyncio.run(
            remove_run_blocks(left.endpoints, left.token, left.run_id, left.timeout, left.concurrency, left.fleet)
        )
    except Exception as e:  # noqa: BLE001 - reported, and the exit status says so; the figures stand
        members = " on every member" if left.fleet else ""
        print(
            f"{prog}: could not remove the run's blocks from {left.where} ({error_kind(e)}: {e}); "
            f"delete the tenant's keys starting with {prefix}{members}",
            file=sys.stderr,
        )
        return None
    every = " from every member" if left.fleet else ""
    return f"{left.where}: the run's {removed} blocks ({prefix}*) were deleted{every} (--keep keeps them)"


def say(msg: str) -> None:
    print(msg, flush=True)


@contextlib.contextmanager
def workspace() -> Iterator[tuple[Path, Processes]]:
    base = default_base_dir()
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-run-", dir=base))
    procs = Processes()
    try:
        yield root, procs
    finally:
        procs.stop_all()
        shutil.rmtree(root, ignore_errors=True)


def execute(opts: RunOptions) -> int:
    blocks = make_blocks(opts)
    total = opts.blocks * opts.block_bytes
    notes: list[str] = []
    skipped: dict[str, str] = {}
    results: dict[str, Any] = {}
    say(
        f"kvstore-bench run: {opts.blocks} blocks x {fmt_bytes(opts.block_bytes).split(' = ')[-1]}"
        f" = {fmt_bytes(total).split(' = ')[-1]}; samples {', '.join(blocks.sources)}"
    )
    cleaned: str | None = ""  # what was done with an existing daemon's tenant; None: removing failed
    with workspace() as (root, procs):
        fs = mount_of(root)
        need = total * 3 + 256 * 1024 * 1024
        local_data = opts.endpoint is None or "nginx" in opts.peers  # else the data is the endpoint's
        if local_data and shutil.disk_usage(root).free < need:
            raise ValueError(f"argument --blocks: {root} has too little free space for {fmt_bytes(need)}")
        if opts.endpoint is None:
            kv = Kvstore(procs, root, "fsync")
            if opts.block_bytes > DAEMON_MAX_BLOCK:
                kv.env["KVSTORE_MAX_BLOCK_SIZE"] = str(opts.block_bytes)
            kv.start(1)
            token = kv.create_tenant("bench", opts.policy)
            endpoint = f"http://127.0.0.1:{kv.port}"
            say(f"started kvstore on {endpoint} (data dir {root}/data, {fs[1]}), tenant 'bench' policy {opts.policy}")
            if fs[1] in MEMORY_FS:
                notes.append(f"the data dir is on {fs[1]} (memory), not a disk")
        else:
            endpoint, token = opts.endpoint, opts.token or ""
        target = KvstoreTarget(endpoint, token, opts.timeout, opts.concurrency)
        try:
            results["kvstore"] = asyncio.run(measure(target, blocks, opts))
        finally:  # an existing daemon keeps nothing of a run, finished or not (unless --keep)
            if opts.endpoint is not None:
                left = Leftovers((endpoint,), token, blocks.run_id, opts.keep, opts.timeout, opts.concurrency)
                cleaned = clean_endpoint(left)
        if cleaned:
            notes.append(cleaned)

        for peer in opts.peers:
            if peer == "redis":
                if shutil.which(REDIS_SERVER) is None:
                    skipped["redis"] = f"redis-server is not installed (install: {INSTALL_HINT})"
                    continue
                if total * 2 > mem_available():
                    skipped["redis"] = f"the data set ({fmt_bytes(total)}) is over half the available memory"
                    continue
                port = start_redis(procs, root)
                results["redis"] = asyncio.run(measure(RedisTarget(port, opts.concurrency), blocks, opts))
            elif peer == "nginx":
                from .http_bench import NGINX

                if not NGINX.exists():
                    skipped["nginx"] = f"{NGINX} is not installed (install: {INSTALL_HINT})"
                    continue
                ng = Nginx(procs, root / "nginx")
                ng.root.mkdir()
                ng.write_files(DataSet(blocks.keys, blocks.distinct, [0], blocks.sources))
                ng.start(1)
                nt = NginxTarget(ng.port, opts.concurrency, opts.timeout)
                results["nginx"] = asyncio.run(measure(nt, blocks, opts))
                ng.stop()
                notes.append("nginx serves reads only (static files): its run is all reads, writes skipped")
    for peer, why in skipped.items():
        say(f"{peer}: skipped: {why}")
    kvr = results["kvstore"]
    ratios: dict[str, dict[str, float | None]] = {}
    for name, r in results.items():
        if name == "kvstore":
            continue
        rr: dict[str, float | None] = {
            "read_gbps": ratio(kvr["read_gbps"], r["read_gbps"]),
            "get_p50_ms": ratio(kvr["latency"]["get"]["p50_ms"], r["latency"]["get"]["p50_ms"]),
            "get_p99_ms": ratio(kvr["latency"]["get"]["p99_ms"], r["latency"]["get"]["p99_ms"]),
        }
        if not r["reads_only"]:
            rr["gbps"] = ratio(kvr["gbps"], r["gbps"])
            rr["write_gbps"] = ratio(kvr["write_gbps"], r["write_gbps"])
            rr["put_p50_ms"] = ratio(kvr["latency"]["put"]["p50_ms"], r["latency"]["put"]["p50_ms"])
        ratios[name] = rr
    if ratios:
        notes.append("ratios kvstore/peer: above 1 means kvstore is higher (faster for GB/s, slower for latency)")
    shard = tp_shard(opts.model, opts.tp)
    doc: dict[str, Any] = {
        "benchmark": "kvstore-bench run",
        "formulas": FORMULAS,
        "workload": {
            "model": {
                "name": opts.model.name,
                "layers": opts.model.layers,
                "kv_heads": opts.model.kv_heads,
                "head_dim": opts.model.head_dim,
                "dtype_bytes": opts.model.dtype_bytes,
            },
            "tokens_per_block": opts.tokens_per_block,
            "tp": opts.tp,
            "kv_heads_per_rank": shard.kv_heads_per_rank,
            "block_bytes": opts.block_bytes,
            "blocks": opts.blocks,
            "distinct_contents": len(blocks.distinct),
            "concurrency": opts.concurrency,
            "duration_s": opts.duration,
            "ops": opts.ops,
            "read_ratio": opts.read_ratio,
            "hit_ratio": opts.hit_ratio,
            "policy": opts.policy if opts.endpoint is None else None,
            "endpoint": opts.endpoint,
            "short": opts.short,
            "samples": blocks.sources,
        },
        "environment": {"cpu_count": os.cpu_count(), "tmp_fs": fs[1], "python": sys.version.split()[0]},
        "results": results,
        "ratios": ratios,
        "skipped": skipped,
        "notes": notes,
        "ttft": ttft_doc(opts, kvr["read_gbps"]),
    }
    say(render(doc))
    if opts.json_path is not None:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(doc, indent=1) + "\n")
        say(f"wrote {opts.json_path}")
    if opts.png_path is not None:
        write_png(opts.png_path, doc)
        say(f"wrote {opts.png_path}")
    return 0 if cleaned is not None else 1


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    opts = build_options(args, parser.error)
    try:
        with sigterm_as_exit():
            return execute(opts)
    except ValueError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print("kvstore-bench run: interrupted; servers stopped, temp dir removed", file=sys.stderr)
        return 128 + signal.SIGINT
