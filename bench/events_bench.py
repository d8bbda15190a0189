"""What residency events cost the store, and how fast one subscriber takes
them.

Two daemons (``durability = "interval"``: the daemons' work, not the
disk's fsync latency) run side by side: ``off`` has no event subscriber (the bus
numbers events for no one), ``on`` publishes on ZMQ (``events_zmq``) to a
subscriber and streams ``GET /v1/events`` to another, both in a separate
process that reads everything. Rounds alternate between the two (noise
lands on both): each round PUTs ``--blocks`` new blocks of ``--block-size``
at ``--depth`` outstanding, then GETs them; reported: PUT MB/s and GET p99,
medians, and on/off ratios per round. Then a burst of ``--burst`` one-byte
blocks (batch puts of 1,000) into ``on``: the events per second the SSE
subscriber received, and whether it saw a gap.

    kvstore-bench events [--blocks 500] [--block-size 64KiB] [--depth 16] [--repeats 3] [--burst 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from .harness import free_port, percentile

# The subscribers' process: an SSE stream and a ZMQ SUB socket, counted until
# the stream has seen WANT events (or stayed quiet for 10 s); one JSON line out.
SUBSCRIBER = r"""
import json, sys, threading, time, urllib.request, zmq
base, token, zmq_ep = sys.argv[1], sys.argv[2], sys.argv[3]
n = {"zmq": 0, "events": 0, "gaps": 0, "first": 0.0, "last": 0.0}
def zmq_reader():
    ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(zmq_ep)
    while True:
        s.recv_multipart(); n["zmq"] += 1
def sse_reader():
    req = urllib.request.Request(base + "/v1/events"); req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"event: gap"):
                n["gaps"] += 1
            elif line.startswith(b"id: "):
                now = time.monotonic(); n["first"] = n["first"] or now; n["last"] = now; n["events"] += 1
for fn in (zmq_reader, sse_reader):
    threading.Thread(target=fn, daemon=True).start()
time.sleep(0.5)
print("ready", flush=True)
want = int(sys.stdin.readline())
quiet_since, seen = time.monotonic(), -1
while n["events"] < want and time.monotonic() - quiet_since < 10:
    if n["events"] != seen:
        seen, quiet_since = n["events"], time.monotonic()
    time.sleep(0.05)
out = {"events": n["events"], "gaps": n["gaps"], "seconds": n["last"] - n["first"], "zmq_batches": n["zmq"]}
print(json.dumps(out), flush=True)
"""


def _in_process(n: int) -> dict[str, float]:
    """Events per second of one core: publishing on the bus (what a write
    pays), formatting them for an SSE subscriber, encoding them for ZMQ."""
    import asyncio as aio

    from kvstore.events.bus import EventBus
    from kvstore.events.vllm_wire import pack_batch, vllm_events
    from kvstore.metrics import Metrics
    from kvstore.transport.http.routes.events import sse_message

    async def run() -> dict[str, float]:
        bus = EventBus(n, n, Metrics())
        sub = bus.subscribe()
        t0 = time.perf_counter()
        for i in range(n):
            bus.publish("t", "stored", "put", "local", [f"k{i}"], [65536])
        publish = time.perf_counter() - t0
        items = sub.drain()
        t0 = time.perf_counter()
        text = "".join(sse_message(item) for item in items)
        sse = time.perf_counter() - t0
        mediums = {"local": "STORAGE", "object": "OBJECT_STORE"}
        t0 = time.perf_counter()
        for at in range(0, len(items), 64):  # batches of 64 events, as a busy publisher sends them
            evs = [e for item in items[at : at + 64] for e in vllm_events(item, mediums, "map")]  # type: ignore[arg-type]
            pack_batch(time.time(), evs)
        zmq_s = time.perf_counter() - t0
        assert len(text) > n
        return {"publish_per_s": n / publish, "sse_per_s": n / sse, "zmq_per_s": n / zmq_s}

    return aio.run(run())


async def _round(c: AsyncClient, prefix: str, n: int, data: bytes, depth: int) -> dict[str, float]:
    keys = [f"{prefix}{i:06d}" for i in range(n)]
    sem = asyncio.Semaphore(depth)

    async def put(k: str) -> None:
        async with sem:
            assert await c.put(k, data)

    lat: list[float] = []
    buf = bytearray(len(data))

    async def get(k: str) -> None:
        async with sem:
            t0 = time.perf_counter()
            assert await c.get_into(k, buf) == len(data)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(put(k) for k in keys))
    put_s = time.perf_counter() - t0
    await asyncio.gather(*(get(k) for k in keys))
    return {"put_mbps": n * len(data) / put_s / 1e6, "puts_per_s": n / put_s, "get_p99_ms": percentile(lat, 0.99) * 1e3}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-bench events", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=500, help="new blocks PUT, then read, per round (default 500)")
    p.add_argument("--block-size", default="64KiB", help="bytes per block (default 64KiB)")
    p.add_argument("--depth", type=int, default=16, help="requests outstanding (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument(
        "--burst",
        type=int,
        default=20_000,
        help="one-byte blocks PUT at the end, for the subscriber's rate (default 20000)",
    )
    p.add_argument(
        "--in-process",
        type=int,
        default=200_000,
        help="events for the one-core rates, in this process (default 200000)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        size = parse_size("--block-size", args.block_size)
    except ConfigError as e:
        p.error(str(e))
    if min(args.blocks, args.depth, args.repeats, args.burst, args.in_process) < 1:
        p.error("--blocks, --depth, --repeats, --burst and --in-process must be at least 1")
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    zmq_ep = f"tcp://127.0.0.1:{free_port()}"
    # durability "interval": the figures are the daemon's work, not this disk's fsync latency.
    common = {"durability": "interval"}
    with daemon(common) as off, daemon(common | {"events_zmq": zmq_ep}) as on:
        sub = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, on.base, on.admin, zmq_ep],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sub.stdout is not None and sub.stdin is not None
        assert sub.stdout.readline().strip() == "ready"

        async def measure() -> dict[str, Any]:
            runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            async with (
                AsyncClient(off.base, off.token, strict=True, timeout=60) as c_off,
                AsyncClient(on.base, on.token, strict=True, timeout=60) as c_on,
            ):
                for r in range(args.repeats):
                    for name, c in (("off", c_off), ("on", c_on)):
                        runs[name].append(await _round(c, f"r{r}-", args.blocks, data, args.depth))
                t0 = time.perf_counter()
                tiny = [(f"t{i:07d}", b"x") for i in range(args.burst)]
                for at in range(0, len(tiny), 1000):
                    assert all(await c_on.put_many(tiny[at : at + 1000]))
                burst_s = time.perf_counter() - t0
            out: dict[str, Any] = {n: {m: statistics.median(x[m] for x in rs) for m in rs[0]} for n, rs in runs.items()}
            out["on_vs_off"] = {
                m: statistics.median(a[m] / b[m] for a, b in zip(runs["on"], runs["off"], strict=True))
                for m in runs["on"][0]
            }
            out["burst"] = {"blocks": args.burst, "put_seconds": burst_s}
            return out

        results = asyncio.run(measure())
        results["in_process"] = _in_process(args.in_process)
        total = args.repeats * args.blocks + args.burst  # every event the "on" daemon published
        sub.stdin.write(f"{total}\n")
        sub.stdin.flush()
        line = sub.stdout.readline()
        sub.kill()
        sub.wait()
        sub.stdin.close()
        sub.stdout.close()
        seen = json.loads(line)
        results["subscriber"] = seen | {"events_per_s": seen["events"] / seen["seconds"] if seen["seconds"] else 0.0}
    r = results
    print(f"{args.blocks} x {size} B blocks at depth {args.depth}, {args.repeats} rounds (medians)")
    print(f"{'':6} {'PUT MB/s':>9} {'PUT/s':>8} {'GET p99 ms':>11}")
    for name in ("off", "on"):
        x = r[name]
        print(f"{name:6} {x['put_mbps']:9.1f} {x['puts_per_s']:8.0f} {x['get_p99_ms']:11.2f}")
    x = r["on_vs_off"]
    print(f"{'on/off':6} {x['put_mbps']:8.2f}x {x['puts_per_s']:7.2f}x {x['get_p99_ms']:10.2f}x")
    s = r["subscriber"]
    print(
        f"burst: {args.burst} one-byte blocks put in {r['burst']['put_seconds']:.2f} s; the SSE subscriber got "
        f"{s['events']} events ({s['events_per_s']:.0f}/s, {s['gaps']} gaps); ZMQ: {s['zmq_batches']} batches"
    )
    x = r["in_process"]
    print(
        f"one core: {x['publish_per_s']:.0f} events/s published on the bus, {x['sse_per_s']:.0f}/s formatted for SSE, "
        f"{x['zmq_per_s']:.0f}/s encoded for ZMQ (vLLM's format)"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
