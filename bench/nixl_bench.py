"""NIXL reads against HTTP GET of the same blocks and a plain socket copy,
in one run (the targets, over TCP: NIXL >= 1.0x the daemon's HTTP GET and
>= 0.7x a plain socket copy, direct tenant).

Starts the daemon (``kvstore serve``) with ``nixl = true`` (UCX on ``--ucx-devices``, TCP by
default) on a fresh data directory, loads ``--blocks`` direct blocks of
``--block-size`` (real KV bytes, repeated), then reads all of them with
``AsyncClient.get_into`` at 1 and ``--depth`` outstanding reads:

* ``nixl``: ``transport="nixl"``: POST /v1/xfer/read, a one-sided READ into
  the caller's (registered) buffer, POST /v1/xfer/release;
* ``nixl-many``: ``get_many_into`` of ``--depth`` keys at a time over NIXL
  (one control call, one transfer; latency per batch);
* ``http``: ``transport="http"``: GET into the same buffers;
* ``socket``: another process writes the same number of bytes into a TCP
  socket on 127.0.0.1 and this one reads them into a buffer (the floor).

Passes alternate between the transports round by round, so the noise of a
shared machine lands on all of them. Each figure is the median of
``--repeats`` passes: GB/s, p50/p99 per block, GB per daemon CPU-second
(the daemon's user+system time over the pass: one-sided transfers should
leave the daemon cool), and the median of each pass's ratio to the HTTP and
socket passes of its own round.

    kvstore-bench nixl [--blocks 64] [--block-size 2MiB] [--depth 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvstore_client import AsyncClient

from kvstore.config import parse_size
from kvstore.errors import ConfigError

from .daemon import daemon
from .harness import percentile, pid_cpu_seconds
from .samples import GEMMA_BF16 as SAMPLE

GB = 1e9


async def _pass(
    client: AsyncClient, keys: list[str], size: int, depth: int, pid: int, batch: bool = False
) -> dict[str, float]:
    """``depth`` reads outstanding, or (``batch``) ``get_many_into`` of
    ``depth`` keys at a time, one batch outstanding (latency: per batch)."""
    bufs = [bytearray(size) for _ in range(depth)]
    free = list(range(depth))
    lat: list[float] = []
    sem = asyncio.Semaphore(depth)

    async def one(k: str) -> None:
        async with sem:
            i = free.pop()
            t0 = time.perf_counter()
            n = await client.get_into(k, bufs[i])
            lat.append(time.perf_counter() - t0)
            free.append(i)
            assert n == size, f"{k}: {n}"

    async def batches() -> None:
        for at in range(0, len(keys), depth):
            part = keys[at : at + depth]
            t0 = time.perf_counter()
            got = await client.get_many_into(part, bufs[: len(part)])
            lat.append(time.perf_counter() - t0)
            assert got == [size] * len(part), f"{part}: {got}"

    cpu0, t0 = pid_cpu_seconds(pid), time.perf_counter()
    if batch:
        await batches()
    else:
        await asyncio.gather(*(one(k) for k in keys))
    wall, cpu = time.perf_counter() - t0, pid_cpu_seconds(pid) - cpu0
    moved = size * len(keys) / GB
    return {
        "gbps": moved / wall,
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "gb_per_daemon_cpu_s": moved / cpu if cpu > 0 else float("inf"),
    }


def _socket_copy(total: int, size: int) -> float:
    """GB/s of ``total`` bytes written by another process into a loopback TCP socket."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        code = (
            f"import socket;s=socket.create_connection(('127.0.0.1',{port}));b=bytes({size})\n"
            f"for _ in range({total // size}): s.sendall(b)\ns.close()"
        )
        child = subprocess.Popen([sys.executable, "-c", code])
        conn, _ = srv.accept()
        buf = bytearray(size)
        mv = memoryview(buf)
        got, t0 = 0, time.perf_counter()
        with conn:
            while got < total:
                n = conn.recv_into(mv[: min(size, total - got)])
                if not n:
                    break
                got += n
        dt = time.perf_counter() - t0
        child.wait(30)
    return got / dt / GB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-bench nixl", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="direct blocks stored, then read by every pass (default 64)")
    p.add_argument("--block-size", default="2MiB", help="bytes per block (default 2MiB)")
    p.add_argument("--depth", type=int, default=8, help="outstanding reads of the second run (default 8)")
    p.add_argument("--repeats", type=int, default=5, help="rounds; figures are medians (default 5)")
    p.add_argument(
        "--ucx-devices", default="lo", help="UCX devices of the daemon's and the client's agents (default lo)"
    )
    p.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for both agents (default tcp; '' for UCX's choice)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        size = parse_size("--block-size", args.block_size)
    except ConfigError as e:
        p.error(str(e))
    if args.blocks < 1 or args.depth < 1 or args.repeats < 1:
        p.error("--blocks, --depth and --repeats must be at least 1")
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    settings = {"nixl": "1", "nixl_devices": args.ucx_devices}
    with daemon(settings, ["--max-block-size", str(max(size, 4 << 20))]) as d:
        proc, base, token = d.proc, d.base, d.token
        sample = SAMPLE.read_bytes()
        data = (sample * (size // len(sample) + 1))[:size]
        keys = [f"b{i:05d}" for i in range(args.blocks)]

        async def measure() -> dict[str, Any]:
            out: dict[str, Any] = {}
            async with AsyncClient(base, token, strict=True, timeout=60) as c:
                await c.put_many([(k, data) for k in keys])
            # Passes alternate between the transports (and the socket copy), so a burst of
            # noise on this shared machine lands on all of them; figures are medians.
            nixl = AsyncClient(base, token, strict=True, timeout=60, transport="nixl", nixl_devices=args.ucx_devices)
            http = AsyncClient(base, token, strict=True, timeout=60)
            async with nixl, http:
                for c in (nixl, http):
                    await _pass(c, keys, size, args.depth, proc.pid)  # warm: registrations, connections, page cache
                runs: dict[str, list[dict[str, float]]] = {}
                for _ in range(args.repeats):
                    for depth in (1, args.depth):
                        for name, c in (("nixl", nixl), ("http", http)):
                            runs.setdefault(f"{name}@{depth}", []).append(await _pass(c, keys, size, depth, proc.pid))
                    many = await _pass(nixl, keys, size, args.depth, proc.pid, True)
                    runs.setdefault(f"nixl-many@{args.depth}", []).append(many)
                    sock = await asyncio.to_thread(_socket_copy, size * args.blocks, size)
                    runs.setdefault("socket", []).append({"gbps": sock})
                assert nixl.stats["nixl_fallbacks"] == 0, nixl.stats
            for name, rs in runs.items():
                out[name] = {m: statistics.median(r[m] for r in rs) for m in rs[0]}
            for name, rs in runs.items():  # each pass against its peers of the same round
                if name != "socket":
                    peer = runs["http@" + name.split("@")[1]]
                    out[name]["vs_http"] = statistics.median(
                        r["gbps"] / h["gbps"] for r, h in zip(rs, peer, strict=True)
                    )
                    out[name]["vs_socket"] = statistics.median(
                        r["gbps"] / k["gbps"] for r, k in zip(rs, runs["socket"], strict=True)
                    )
            return out

        results = asyncio.run(measure())
        sock = results["socket"]["gbps"]
    print(f"{args.blocks} x {size} B direct blocks, UCX_TLS={args.ucx_tls or 'default'}, medians of {args.repeats}")
    print(f"{'':13} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'GB/daemon-cpu-s':>16} {'vs http':>8} {'vs socket':>9}")
    rows = [f"{name}@{depth}" for name in ("nixl", "http") for depth in (1, args.depth)]
    for row in [*rows[:2], f"nixl-many@{args.depth}", *rows[2:]]:
        r = results[row]
        print(
            f"{row:13} {r['gbps']:7.2f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f}"
            f" {r['gb_per_daemon_cpu_s']:16.2f} {r['vs_http']:7.2f}x {r['vs_socket']:8.2f}x"
        )
    print(f"{'socket':13} {sock:7.2f}")
    if args.json:
        args.json.write_text(json.dumps({"block_size": size, "blocks": args.blocks, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
