"""Requests per second kvstore keeps serving to well-behaved clients while
hostile connections are open, as a ratio to none open.

A benchmark, not a test: it prints a table (and ``--json``) and exits 0. It
starts the daemon (``kvstore serve``) on a fresh data directory (default settings: the
timeouts a production daemon has), creates a tenant and stores ``--keys``
small blocks (4 KiB, cut from the real KV samples of the package's data/kv) and one
2 MiB block, then for each ``--workers`` count and each of ``--runs`` runs:

1. **baseline**: ``--clients`` well-behaved clients, each on one keep-alive
   connection, alternate ``GET /v1/blocks/{key}`` (4 KiB) and
   ``POST /v1/lookup`` (32 keys) for ``--duration`` seconds;
2. **hostile**: ``--hostile`` connections are opened first and held, a
   quarter of each kind: *stalled headers* (a request line and half a
   header, then nothing), *stalled bodies* (a PUT of 1 MiB with 1 KiB sent),
   *idle keep-alives* (one request answered, then nothing), and *slow
   readers* (a GET of the 2 MiB block, never read, with a small receive
   buffer); then the same well-behaved load runs for ``--duration`` seconds;
   then the hostile connections are closed.

Reported: requests/s (medians over the runs), p50/p99 latency, errors, and
hostile/baseline. The load generator is Python (asyncio streams) on the same
machine as the daemon: compare figures within a run, not across machines.

Run: ``.venv/bin/python -m kvstore_bench.hostile_bench --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .daemon import Kvstore
from .harness import Client, Processes, percentile
from .samples import GEMMA_BF16 as KV_SAMPLE

KINDS = ("stalled-headers", "stalled-body", "idle", "slow-reader")
BIG_KEY = "big"


@dataclass(slots=True)
class Phase:
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


async def _read_answer(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def well_behaved(port: int, token: str, keys: list[str], clients: int, duration: float) -> Phase:
    """``clients`` keep-alive connections alternating a small GET and a lookup."""
    auth = f"Authorization: Bearer {token}\r\n"
    lookup = json.dumps({"keys": keys[:32]}).encode()
    gets = [f"GET /v1/blocks/{k} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode() for k in keys]
    post = (
        f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(lookup)}\r\n\r\n"
    ).encode() + lookup
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    end = start + duration

    async def client(i: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        n = i
        try:
            while time.perf_counter() < end:
                request = post if n % 2 else gets[n % len(gets)]
                t0 = time.perf_counter()
                writer.write(request)
                status = await _read_answer(reader)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    errors += 1
                n += 1
        finally:
            writer.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    return Phase(len(latencies), errors, elapsed, percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3)


async def open_hostile(port: int, token: str, n: int) -> list[asyncio.StreamWriter]:
    """``n`` hostile connections, a quarter of each kind in KINDS, held open."""
    auth = f"Authorization: Bearer {token}\r\n"
    held: list[asyncio.StreamWriter] = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        sock = socket.socket()
        if kind == "slow-reader":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        if kind == "stalled-headers":
            writer.write(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\nX-Slow: aaaa")
        elif kind == "stalled-body":
            writer.write(
                f"PUT /v1/blocks/stalled{i} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {1 << 20}\r\n\r\n".encode()
                + b"x" * 1024
            )
        elif kind == "idle":
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            await _read_answer(reader)
        else:
            writer.write(f"GET /v1/blocks/{BIG_KEY} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        await writer.drain()
        held.append(writer)
    return held


def load_data(kv: Kvstore, keys: list[str]) -> str:
    token = kv.create_tenant("bench", "sealed")
    sample = KV_SAMPLE.read_bytes()
    c = Client(kv.port, token)
    try:
        for i, key in enumerate(keys):
            r = c.request("PUT", f"/v1/blocks/{key}", sample[i * 4096 : (i + 1) * 4096])
            if r.status not in (200, 201):
                raise RuntimeError(f"PUT {key}: HTTP {r.status}")
        if c.request("PUT", f"/v1/blocks/{BIG_KEY}", sample[: 2 << 20]).status not in (200, 201):
            raise RuntimeError("PUT big: failed")
    finally:
        c.close()
    return token


async def one_run(port: int, token: str, keys: list[str], a: argparse.Namespace) -> tuple[Phase, Phase]:
    base = await well_behaved(port, token, keys, a.clients, a.duration)
    held = await open_hostile(port, token, a.hostile)
    try:
        await asyncio.sleep(0.5)  # every hostile request has reached the server
        hostile = await well_behaved(port, token, keys, a.clients, a.duration)
    finally:
        for w in held:
            w.transport.abort()
    await asyncio.sleep(1.0)  # the server lets go of them before the next baseline
    return base, hostile


def measure(workers: int, a: argparse.Namespace, root: Path) -> dict[str, Any]:
    procs = Processes()
    kv = Kvstore(procs, root, "fsync")
    keys = [f"k{i:04d}" for i in range(a.keys)]
    try:
        kv.start(workers)
        token = load_data(kv, keys)
        runs = [asyncio.run(one_run(kv.port, token, keys, a)) for _ in range(a.runs)]
    finally:
        kv.stop()
        procs.stop_all()
    base = statistics.median(b.rps for b, _ in runs)
    hostile = statistics.median(h.rps for _, h in runs)
    return {
        "workers": workers,
        "baseline_rps": base,
        "hostile_rps": hostile,
        "ratio": hostile / base if base else None,
        "runs": [{"baseline": asdict(b), "hostile": asdict(h)} for b, h in runs],
    }


def render(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    lines = [
        f"well-behaved: {a.clients} keep-alive clients, GET 4 KiB / lookup of 32 keys alternating, "
        f"{a.duration:g} s per phase, medians of {a.runs} runs; hostile: {a.hostile} connections "
        f"({', '.join(KINDS)}, {a.hostile // len(KINDS)} each)",
        "",
        "| workers | req/s, none open | req/s, hostile open | ratio | p99 ms (none/hostile) | errors (none/hostile) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        p99 = "/".join(f"{statistics.median(x[k]['p99_ms'] for x in r['runs']):.1f}" for k in ("baseline", "hostile"))
        errs = "/".join(str(sum(x[k]["errors"] for x in r["runs"])) for k in ("baseline", "hostile"))
        rps = f"{r['baseline_rps']:,.0f} | {r['hostile_rps']:,.0f}"
        lines.append(f"| {r['workers']} | {rps} | {r['ratio']:.2f} | {p99} | {errs} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2", help="worker counts, comma-separated (default 1,2)")
    p.add_argument("--hostile", type=int, default=300, help="hostile connections held open (default 300)")
    p.add_argument("--clients", type=int, default=8, help="well-behaved keep-alive clients (default 8)")
    p.add_argument("--duration", type=float, default=10, help="seconds per phase (default 10)")
    p.add_argument("--runs", type=int, default=3, help="runs per worker count; medians are reported (default 3)")
    p.add_argument("--keys", type=int, default=64, help="small blocks stored and read (default 64)")
    p.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    results = []
    for workers in (int(w) for w in a.workers.split(",")):
        with tempfile.TemporaryDirectory(prefix="kvstore-hostile-") as tmp:
            results.append(measure(workers, a, Path(tmp)))
    print(render(results, a))
    if a.json:
        a.json.write_text(json.dumps({"options": vars(a) | {"json": str(a.json)}, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
