"""What compaction costs the foreground, and how fast it gives space back.

A benchmark, not a test. It starts the daemon (``kvstore serve``) on a fresh data
directory, loads ``--blocks`` 2 MiB blocks of the real KV-cache samples into a
tenant, deletes ``--dead`` of them at random and seals the segments; then,
``--repeat`` times on a freshly loaded store:

1. **baseline**: ``--readers`` threads GET random live blocks over keep-alive
   HTTP for ``--duration`` seconds; latency per request;
2. **during compaction**: the same readers while ``POST /v1/admin/compact``
   runs (throttled to ``--compact-rate``); only requests that started while it
   ran count.

Reported (medians over the repeats): GET p50/p99 without and with compaction
(and the p99 ratio), the pass's duration, bytes reclaimed per second of
compaction, and its own cost, from ``--repeat`` more passes with no reader
beside them: bytes the daemon read and wrote (``/proc/PID/io``) and CPU
seconds it used, per byte reclaimed.

Run: ``.venv/bin/python -m kvstore_bench.compaction_bench --help``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import MiB, parse_size

from .daemon import Kvstore
from .harness import Client, Processes, percentile, pid_cpu_seconds
from .samples import SAMPLES
from .store_bench import load_samples

BLOCK = 2 * MiB


@dataclass
class Options:
    blocks: int
    dead: float
    readers: int
    duration: float
    repeat: int
    segment_size: int
    compact_rate: int
    policy: str
    samples: Path
    base_dir: Path | None


@dataclass
class Pass:
    base_p50: float = 0.0
    base_p99: float = 0.0
    base_rps: float = 0.0
    during_p50: float = 0.0
    during_p99: float = 0.0
    during_rps: float = 0.0
    seconds: float = 0.0
    reclaimed: int = 0
    copied: int = 0
    io_read: int = 0
    io_written: int = 0
    cpu_s: float = 0.0
    segments: int = 0
    notes: list[str] = field(default_factory=list)


def _proc_io(pid: int) -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _readers(
    kv: Kvstore, token: str, keys: list[str], n: int, done: Callable[[], bool], window: list[float] | None
) -> tuple[list[float], int]:
    """GET random keys until ``done()``; latencies (ms) of requests that
    started inside ``window`` [start, end) (None: all), and how many."""
    lat: list[float] = []
    lock = threading.Lock()

    def run(seed: int) -> None:
        rnd = random.Random(seed)
        c = Client(kv.port, token)
        mine = []
        try:
            while not done():
                t0 = time.monotonic()
                r = c.request("GET", f"/v1/blocks/{rnd.choice(keys)}")
                if r.status != 200:
                    raise RuntimeError(f"GET answered {r.status}: {r.body[:200]!r}")
                if window is None or window[0] <= t0 < window[1]:
                    mine.append((time.monotonic() - t0) * 1000)
        finally:
            c.close()
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, len(lat)


def one_pass(opts: Options, procs: Processes, root: Path, rep: int, readers: bool = True) -> Pass:
    kv = Kvstore(procs, root, "fsync")
    kv.env |= {
        "KVSTORE_SEGMENT_SIZE": str(opts.segment_size),
        "KVSTORE_COMPACT_INTERVAL_S": "0",
        "KVSTORE_COMPACT_RATE": str(opts.compact_rate),
    }
    kv.start(1)
    p = Pass()
    try:
        token = kv.create_tenant("t", opts.policy)
        samples = [b for s in load_samples(opts.samples, BLOCK, ("bf16", "fp16")).values() for b in s.blocks]
        if not samples:
            raise SystemExit(f"no 2 MiB sample blocks under {opts.samples}")
        c = Client(kv.port, token)
        keys = [f"b{i}" for i in range(opts.blocks)]
        for i, k in enumerate(keys):
            r = c.request("PUT", f"/v1/blocks/{k}", samples[i % len(samples)])
            if r.status != 201:
                raise RuntimeError(f"PUT answered {r.status}")
        rnd = random.Random(rep)
        dead = set(rnd.sample(keys, int(len(keys) * opts.dead)))
        for k in dead:
            c.request("DELETE", f"/v1/blocks/{k}")
        c.close()
        if kv.admin("POST", "/v1/admin/flush").status != 200:
            raise RuntimeError("flush failed")
        live = [k for k in keys if k not in dead]
        pid = kv.pgid

        if readers:
            t0 = time.monotonic()
            lat, n = _readers(kv, token, live, opts.readers, lambda: time.monotonic() >= t0 + opts.duration, None)
            p.base_p50, p.base_p99, p.base_rps = percentile(lat, 0.5), percentile(lat, 0.99), n / opts.duration

        result: dict[str, Any] = {}
        window = [float("inf"), float("inf")]
        io0, cpu0 = _proc_io(pid), pid_cpu_seconds(pid)

        def compact() -> None:
            window[0] = time.monotonic()
            r = kv.admin("POST", "/v1/admin/compact")
            window[1] = time.monotonic()
            result.update(r.json() if r.status == 200 else {"error": r.status})

        runner = threading.Thread(target=compact)
        runner.start()
        lat, n = _readers(kv, token, live, opts.readers if readers else 0, lambda: not runner.is_alive(), window)
        runner.join()
        io1, cpu1 = _proc_io(pid), pid_cpu_seconds(pid)
        if "error" in result:
            raise RuntimeError(f"compaction answered {result['error']}")
        p.seconds = window[1] - window[0]
        p.during_p50, p.during_p99, p.during_rps = percentile(lat, 0.5), percentile(lat, 0.99), n / max(p.seconds, 1e-9)
        p.reclaimed, p.copied, p.segments = (
            result["bytes_reclaimed"],
            result["bytes_copied"],
            result["segments_rewritten"],
        )
        p.io_read, p.io_written, p.cpu_s = io1[0] - io0[0], io1[1] - io0[1], cpu1 - cpu0
        if p.seconds < opts.duration:
            p.notes.append("a pass was shorter than the baseline phase: its percentiles rest on fewer requests")
        if p.io_read == 0:
            p.notes.append("the segments were in the page cache: compaction read nothing from the disk")
    finally:
        kv.stop()
    return p


def main(argv: list[str] | None = None) -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--blocks", type=int, default=256, help="2 MiB blocks loaded (default 256 = 512 MiB)")
    a.add_argument("--dead", type=float, default=0.6, help="fraction deleted before compacting (default 0.6)")
    a.add_argument("--readers", type=int, default=4, help="concurrent GET threads (default 4)")
    a.add_argument("--duration", type=float, default=8, help="seconds of the baseline phase (default 8)")
    a.add_argument("--repeat", type=int, default=3)
    a.add_argument("--segment-size", default="64MiB")
    a.add_argument("--compact-rate", default="64MiB", help="compaction's read budget per second (default 64MiB)")
    a.add_argument("--policy", default="sealed", choices=("sealed", "direct"))
    a.add_argument("--samples", type=Path, default=SAMPLES)
    a.add_argument("--base-dir", type=Path, default=None, help="where the data directory goes (default: /tmp)")
    a.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    ns = a.parse_args(argv)
    opts = Options(
        ns.blocks,
        ns.dead,
        ns.readers,
        ns.duration,
        ns.repeat,
        parse_size("--segment-size", ns.segment_size),
        parse_size("--compact-rate", ns.compact_rate),
        ns.policy,
        ns.samples,
        ns.base_dir,
    )
    passes = []
    procs = Processes()
    try:
        for rep in range(opts.repeat):
            with tempfile.TemporaryDirectory(dir=opts.base_dir) as d:
                p = one_pass(opts, procs, Path(d), rep)
                passes.append(p)
                print(
                    f"pass {rep + 1}: GET p99 {p.base_p99:.1f} ms alone, {p.during_p99:.1f} ms during compaction; "
                    f"{p.segments} segments, {p.reclaimed / MiB:.0f} MiB reclaimed in {p.seconds:.1f} s",
                    flush=True,
                )
        alone = []  # the pass's own cost: the same work with no reader beside it
        for rep in range(opts.repeat):
            with tempfile.TemporaryDirectory(dir=opts.base_dir) as d:
                alone.append(one_pass(opts, procs, Path(d), rep, readers=False))
    finally:
        procs.stop_all()

    def med(name: str, of: list[Pass] = passes) -> float:
        return float(statistics.median(float(getattr(p, name)) for p in of))

    reclaimed = med("reclaimed")
    quiet = med("reclaimed", alone)
    doc = {
        "options": {k: str(v) for k, v in vars(opts).items()},
        "get_p50_ms": {"alone": med("base_p50"), "during_compaction": med("during_p50")},
        "get_p99_ms": {"alone": med("base_p99"), "during_compaction": med("during_p99")},
        "get_p99_ratio": med("during_p99") / med("base_p99"),
        "get_per_s": {"alone": med("base_rps"), "during_compaction": med("during_rps")},
        "compaction_s": {"beside_readers": med("seconds"), "alone": med("seconds", alone)},
        "reclaimed_mib_per_s": {
            "beside_readers": reclaimed / MiB / med("seconds"),
            "alone": quiet / MiB / med("seconds", alone),
        },
        "copied_bytes_per_reclaimed_byte": med("copied") / reclaimed if reclaimed else float("nan"),
        # the pass's own cost, measured with no reader beside it
        "disk_read_per_reclaimed_byte": med("io_read", alone) / quiet if quiet else float("nan"),
        "disk_written_per_reclaimed_byte": med("io_written", alone) / quiet if quiet else float("nan"),
        "cpu_s_per_gib_reclaimed": med("cpu_s", alone) / (quiet / (1 << 30)) if quiet else float("nan"),
        "notes": sorted({n for p in passes for n in p.notes}),
    }
    print(json.dumps(doc, indent=2))
    if ns.json is not None:
        ns.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
