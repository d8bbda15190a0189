"""kvstore-bench writes: every write path of the daemon against the disk's own
limit, in one run.

Starts the daemon (``kvstore serve``, one worker unless ``--workers``; ``durability`` from
``--durability``, default the daemon's ``fsync``) on a fresh data directory
under /var/tmp, with a TCP listener, a unix socket and its S3 gateway, a
``direct`` and a ``sealed`` tenant. Blocks are cut from the real KV caches of
the package's ``data/kv`` (or ``--samples``) at random 4 KiB offsets, ``--size``
each (default 2 MiB), new keys in every pass. The targets, ``--depth``
requests at a time (default 8):

* ``loop-buffered``, ``loop-direct``: no daemon; this process writes the
  same bytes to one file in the daemon's data directory's filesystem,
  ``--depth`` blocks then one ``fdatasync`` (what group commit can do at
  best), through the page cache and with ``O_DIRECT`` from one aligned
  buffer: the disk's limit on this machine, the yardstick of every ratio;
* ``http-put-direct``, ``http-put-sealed``: ``PUT /v1/blocks/{key}`` through
  the client library (``AsyncClient.put``) over TCP;
* ``batch-put-direct``: ``AsyncClient.put_many`` (the batch stream, KVB2),
  ``--depth`` blocks per call;
* ``unix-put-direct``: ``AsyncClient.put`` over the daemon's unix socket;
* ``unix-plan-direct``: ``AsyncClient.put_many`` over the unix socket,
  ``--depth`` blocks per call: write plans (the daemon reserves room and
  passes the segment file; this process writes the blocks into it with
  ``O_DIRECT``, then commits their checksums; the daemon reads them back
  with ``O_DIRECT``, checks, syncs and indexes them);
* ``s3-put-direct``: boto3 ``PutObject`` through the S3 gateway (unsigned
  payload, no checksums: what the gateway costs, not what SigV4 costs);
* ``nixl-put-direct`` (only when named in ``--targets``: the daemon then
  runs a NIXL agent): ``AsyncClient(transport="nixl").put_many``, the
  daemon READs the blocks from this process's registered memory (UCX over
  TCP on loopback here), ``--depth`` blocks per call;
* ``get-after-put``: every block of the last ``http-put-direct`` pass read
  back at once with ``AsyncClient.get`` (a block read right after its PUT:
  with O_DIRECT writes it is not in the page cache).

LMCache's ``fs`` adapter is measured by ``lmcache_mp_bench`` against the
MP adapter.

Reported per target, medians over ``--repeats`` rounds (targets take turns
in an order that rotates each round): GB/s (1e9 bytes of block data),
requests/s, the daemon's CPU seconds per GB and milliseconds per request
(``/proc``, the daemon and its workers), this process's CPU per GB, and the
ratio to ``loop-direct`` of the same round. Every block of every pass is
read back and compared after the clock stops (``--no-verify`` skips it).

    kvstore-bench writes [--size 2MiB] [--blocks 64] [--depth 8] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import mmap
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .daemon import Daemon, _admin, daemon
from .harness import cpu_seconds, free_port, tree_cpu_seconds
from .s3_bench import cut_objects, s3_client
from .samples import SAMPLES, load_pool

ALIGN = 4096
T = TypeVar("T")


@dataclass
class Pass:
    seconds: float
    nbytes: int
    requests: int
    daemon_cpu_s: float
    client_cpu_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass
class Target:
    name: str
    passes: list[Pass] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    note: str = ""


class Clock:
    """Wall time, the daemon's CPU and this process's CPU over a ``with``
    block (sync or async code alike); :meth:`result` is the pass it timed."""

    def __init__(self, pid: int, nbytes: int, requests: int) -> None:
        self.pid, self.nbytes, self.requests = pid, nbytes, requests

    def __enter__(self) -> Clock:
        self.d0, self.c0, self.t0 = tree_cpu_seconds(self.pid), cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.t1, self.c1, self.d1 = time.perf_counter(), cpu_seconds(), tree_cpu_seconds(self.pid)

    def result(self) -> Pass:
        return Pass(self.t1 - self.t0, self.nbytes, self.requests, self.d1 - self.d0, self.c1 - self.c0)


def measured(pid: int, nbytes: int, requests: int, run: Callable[[], object]) -> Pass:
    with Clock(pid, nbytes, requests) as clock:
        run()
    return clock.result()


def write_loop(path: Path, blocks: list[bytes], depth: int, direct: bool) -> None:
    """Write ``blocks`` one after another to a new file, fdatasync after every ``depth``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    buf = mmap.mmap(-1, max(len(b) for b in blocks) + ALIGN) if direct else None
    try:
        pos = 0
        for i, b in enumerate(blocks):
            if buf is not None:
                n = -(-len(b) // ALIGN) * ALIGN
                buf[: len(b)] = b
                view = memoryview(buf)[:n]
            else:
                view = memoryview(b)
            pos += os.pwrite(fd, view, pos)
            if (i + 1) % depth == 0:
                os.fdatasync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


@contextmanager
def profiled(out: Path | None, name: str, pid: int, tools: str = "py-spy,perf") -> Iterator[None]:
    """Sample daemon ``pid`` while the block runs: ``py-spy record --native``
    (raw stacks, OUT/NAME.pyspy.txt) and ``perf record -g`` (OUT/NAME.perf.data),
    whichever is installed; nothing when ``out`` is None."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if "py-spy" in tools and Path(spy).exists():
        cmd = [
            spy,
            "record",
            "--native",
            "-r",
            "250",
            "-f",
            "raw",
            "-p",
            str(pid),
            "-o",
            str(out / f"{name}.pyspy.txt"),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    perf = shutil.which("perf")
    if perf and "perf" in tools:
        cmd = [perf, "record", "-F", "499", "-g", "-p", str(pid), "-o", str(out / f"{name}.perf.data")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # attached before the clock starts
    try:
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            proc.wait(60)


async def gather_bounded(depth: int, jobs: list[Callable[[], Awaitable[object]]]) -> list[object]:
    sem = asyncio.Semaphore(depth)

    async def one(job: Callable[[], Awaitable[object]]) -> object:
        async with sem:
            return await job()

    return list(await asyncio.gather(*(one(j) for j in jobs)))


class Bench:
    def __init__(self, d: Daemon, sock: Path, s3_port: int, args: argparse.Namespace) -> None:
        self.d = d
        self.sock = sock
        self.args = args
        self.pid = d.proc.pid
        self.sealed_token = _admin(d.base, d.admin, "/v1/admin/tenants", {"name": "sealed", "policy": "sealed"})[
            "token"
        ]
        key = _admin(d.base, d.admin, "/v1/admin/tenants/bench/s3-keys", {})
        self.s3 = s3_client(
            f"http://127.0.0.1:{s3_port}", key["access_key_id"], key["secret_access_key"], args.depth, False
        )
        self.s3.create_bucket(Bucket="writes")
        self.loop = asyncio.new_event_loop()
        self.written: dict[str, tuple[str, list[tuple[str, bytes]]]] = {}  # target -> (endpoint, blocks)
        self.s3_written: list[tuple[str, bytes]] = []  # the last s3-put-direct pass's objects

    def close(self) -> None:
        self.s3.close()
        self.loop.close()

    def client(self, endpoint: str, token: str, nixl: bool = False, name: str = "") -> Any:
        from kvstore_client import AsyncClient

        extra: dict[str, Any] = {"transport": "nixl", "nixl_devices": NIXL_DEVICES} if nixl else {}
        if name.startswith("tcp-plan"):
            extra["encode"] = "client"  # uploads over TCP only when asked for
        return AsyncClient(endpoint, token, strict=True, timeout=120, retries=0, pool_size=self.args.depth, **extra)

    def run_async(self, make: Callable[[], Awaitable[T]]) -> T:
        return self.loop.run_until_complete(make())

    def target(self, name: str, items: list[tuple[str, bytes]], tmp: Path, profile: Path | None = None) -> Pass:
        with profiled(profile, name, self.pid, self.args.profiler):
            return self._target(name, items, tmp)

    def _target(self, name: str, items: list[tuple[str, bytes]], tmp: Path) -> Pass:
        depth, nbytes, n = self.args.depth, sum(len(b) for _, b in items), len(items)
        blocks = [b for _, b in items]
        if name in ("loop-buffered", "loop-direct"):
            path = tmp / f"{name}.dat"
            return measured(self.pid, nbytes, n, lambda: write_loop(path, blocks, depth, name == "loop-direct"))
        if name == "s3-put-direct":
            self.s3_written = items
            with ThreadPoolExecutor(depth) as pool:
                return measured(
                    self.pid,
                    nbytes,
                    n,
                    lambda: list(
                        pool.map(lambda kv: self.s3.put_object(Bucket="writes", Key=kv[0], Body=kv[1]), items)
                    ),
                )
        endpoint = f"unix:{self.sock}" if name.startswith("unix") else self.d.base
        token = self.sealed_token if name.endswith("sealed") else self.d.token

        async def go() -> Pass:
            async with self.client(endpoint, token, nixl=name.startswith("nixl"), name=name) as c:
                if name.startswith(("nixl", "unix-plan", "tcp-plan")):  # connected (and registered), off the clock
                    await c.put_many([(items[0][0] + "-warm", items[0][1])])
                else:
                    await c.put(items[0][0] + "-warm", items[0][1])  # connection up, off the clock
                if name.startswith(("batch", "nixl", "unix-plan", "tcp-plan")):
                    # Write plans: two plans of depth/2 in flight (depth blocks in all), so that
                    # one plan's blocks are written while the other's commit syncs.
                    width = 2 if name.startswith(("unix-plan", "tcp-plan")) and depth > 1 else 1
                    per = depth // width
                    chunks = [items[i : i + per] for i in range(0, n, per)]
                    jobs: list[Callable[[], Awaitable[object]]] = [functools.partial(c.put_many, ch) for ch in chunks]
                else:
                    jobs, width = [functools.partial(c.put, k, b) for k, b in items], depth
                with Clock(self.pid, nbytes, n) as clock:
                    await gather_bounded(width, jobs)
                return clock.result()

        p = self.run_async(go)
        self.written[name] = (endpoint, items)
        return p

    def get_after_put(self) -> Pass:
        endpoint, items = self.written["http-put-direct"]
        nbytes, n = sum(len(b) for _, b in items), len(items)

        async def go() -> tuple[Pass, list[object]]:
            async with self.client(endpoint, self.d.token) as c:
                jobs: list[Callable[[], Awaitable[object]]] = [functools.partial(c.get, k) for k, _ in items]
                with Clock(self.pid, nbytes, n) as clock:
                    got = await gather_bounded(self.args.depth, jobs)
                return clock.result(), got

        p, got = self.run_async(go)
        if not self.args.no_verify:
            bad = [k for (k, b), g in zip(items, got, strict=True) if not isinstance(g, bytes | bytearray) or g != b]
            if bad:
                raise SystemExit(f"get-after-put: {len(bad)} blocks read back wrong, first {bad[0]}")
        return p

    def verify(self, name: str) -> None:
        if self.args.no_verify or name.startswith("loop"):
            return
        if name == "s3-put-direct":  # read back through the gateway
            for k, b in self.s3_written:
                if self.s3.get_object(Bucket="writes", Key=k)["Body"].read() != b:
                    raise SystemExit(f"{name}: object {k} reads back wrong")
            return
        endpoint, items = self.written[name]
        token = self.sealed_token if name.endswith("sealed") else self.d.token

        async def go() -> None:
            async with self.client(endpoint, token) as c:
                for k, b in items:
                    got = await c.get(k)
                    if got is None or bytes(got) != b:
                        raise SystemExit(f"{name}: block {k} reads back wrong")

        self.run_async(go)


TARGETS = (
    "loop-buffered",
    "loop-direct",
    "http-put-direct",
    "http-put-sealed",
    "batch-put-direct",
    "unix-put-direct",
    "unix-plan-direct",
    "unix-plan-sealed",
    "tcp-plan-sealed",
    "s3-put-direct",
)
# Only when asked for (--targets ...,nixl-put-direct): the daemon then runs a NIXL
# agent (UCX over TCP on loopback here), whose progress thread is daemon CPU too.
OPTIONAL = ("nixl-put-direct",)
NIXL_DEVICES = "lo"
NOT_BUILT: dict[str, str] = {}


def parse_size(text: str) -> int:
    from kvstore.config import parse_size as parse

    return int(parse("--size", text))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvstore-bench writes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=2 << 20, help="bytes per block (default 2MiB)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per pass (default 64)")
    ap.add_argument("--depth", type=int, default=8, help="requests at a time (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="passes per target; figures are medians (default 3)")
    ap.add_argument("--workers", type=int, default=1, help="daemon worker processes (default 1)")
    ap.add_argument(
        "--durability", choices=("fsync", "interval"), default="fsync", help="the daemon's durability (default fsync)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a daemon setting (repeatable)")
    ap.add_argument(
        "--samples", type=Path, default=SAMPLES, help="a directory of *.bin KV samples (default: the ones shipped here)"
    )
    ap.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"what to measure, comma-separated, of {', '.join((*TARGETS, *OPTIONAL))} (default: all but "
        f"{', '.join(OPTIONAL)}); loop-direct always runs",
    )
    ap.add_argument("--no-verify", action="store_true", help="do not read the blocks back and compare their bytes")
    ap.add_argument("--profile", type=Path, help="profile the daemon during each target's first pass into this folder")
    ap.add_argument("--profiler", default="py-spy,perf", help="py-spy, perf or both (default), comma-separated")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.size < 1 or args.blocks < 1 or args.depth < 1 or args.repeats < 1:
        ap.error("--size, --blocks, --depth and --repeats must be positive")
    asked = args.targets.split(",")
    chosen = tuple(n for n in (*TARGETS, *OPTIONAL) if n in asked or n == "loop-direct")
    unknown = set(asked) - set(TARGETS) - set(OPTIONAL)
    if unknown:
        ap.error(f"--targets: unknown {', '.join(sorted(unknown))}; known: {', '.join((*TARGETS, *OPTIONAL))}")
    settings = {"durability": args.durability, "max_block_size": str(max(args.size, 4 << 20))}
    if "nixl-put-direct" in chosen:
        import importlib.util

        if importlib.util.find_spec("nixl") is None:
            ap.error("--targets nixl-put-direct needs NIXL (pip install 'kvstore-client[nixl]')")
        os.environ.setdefault("UCX_TLS", "tcp")  # passed on to the daemon (bench.daemon passes UCX_*)
        settings |= {"nixl": "1", "nixl_devices": NIXL_DEVICES}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected NAME=VALUE")
        settings[name] = value
    s3_port = free_port()
    settings["s3_gateway_listen"] = f"127.0.0.1:{s3_port}"
    pool = load_pool(args.samples)
    rng = random.Random(7)
    targets = {n: Target(n) for n in chosen}
    if "http-put-direct" in chosen:
        targets["get-after-put"] = Target("get-after-put")
    sock_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-sock-"))
    sock = sock_dir / "kvstore.sock"
    try:
        with daemon(settings, ["--workers", str(args.workers), "--listen", f"unix:{sock}"]) as d:
            bench = Bench(d, sock, s3_port, args)
            try:
                warm = cut_objects(pool, args.size, max(args.depth, 8), rng)
                for name in chosen:  # untimed: connections, buckets, the first segment of each tenant
                    bench.target(name, [(f"warm-{name}-{i}", b) for i, b in enumerate(warm)], d.root)
                for r in range(args.repeats):
                    order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
                    blocks = cut_objects(pool, args.size, args.blocks, rng)
                    passes: dict[str, Pass] = {}
                    for name in order:
                        items = [(f"r{r}-{name}-{i:05d}", b) for i, b in enumerate(blocks)]
                        profile = args.profile if r == 0 and not name.startswith("loop") else None
                        passes[name] = bench.target(name, items, d.root, profile)
                        if name == "http-put-direct":
                            passes["get-after-put"] = bench.get_after_put()
                        bench.verify(name)
                    for name, p in passes.items():
                        targets[name].passes.append(p)
                        targets[name].ratios.append(p.gbps / passes["loop-direct"].gbps)
                    print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {p.gbps:.2f}" for n, p in passes.items()))
            finally:
                bench.close()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    rows = [summary(t) for t in targets.values()]
    print(render(rows, args))
    if args.json is not None:
        doc = {"settings": settings, "args": {k: str(v) for k, v in vars(args).items()}, "targets": rows}
        doc["not_measured"] = NOT_BUILT
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def summary(t: Target) -> dict[str, Any]:
    def med(fn: Callable[[Pass], float]) -> float:
        return statistics.median(fn(p) for p in t.passes)

    return {
        "target": t.name,
        "gbps": med(lambda p: p.gbps),
        "requests_per_s": med(lambda p: p.requests / p.seconds),
        "daemon_cpu_s_per_gb": med(lambda p: p.daemon_cpu_s / (p.nbytes / 1e9)),
        "daemon_cpu_ms_per_request": med(lambda p: 1e3 * p.daemon_cpu_s / p.requests),
        "client_cpu_s_per_gb": med(lambda p: p.client_cpu_s / (p.nbytes / 1e9)),
        "vs_loop_direct": statistics.median(t.ratios),
        "rounds": len(t.passes),
    }


def render(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"writes of {args.blocks} x {args.size} B blocks, depth {args.depth}, {args.workers} worker(s),"
        f" durability {args.durability}; medians of {args.repeats}"
    )
    cols = (
        f"{'target':<18}{'GB/s':>7}{'req/s':>8}{'daemon s/GB':>13}{'ms/req':>8}{'client s/GB':>13}{'÷ loop-direct':>15}"
    )
    lines = [head, cols]
    for r in rows:
        daemon = r["target"].startswith("loop")
        lines.append(
            f"{r['target']:<18}{r['gbps']:>7.2f}{r['requests_per_s']:>8.0f}"
            + (
                f"{'-':>13}{'-':>8}"
                if daemon
                else f"{r['daemon_cpu_s_per_gb']:>13.2f}{r['daemon_cpu_ms_per_request']:>8.2f}"
            )
            + f"{r['client_cpu_s_per_gb']:>13.2f}{r['vs_loop_direct']:>15.2f}"
        )
    lines += [f"{name:<18}not measured: {why}" for name, why in NOT_BUILT.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
