"""kvstore-bench soak: a daemon under a mixed load for minutes or hours, sampled
for what grows.

Starts the daemon (``kvstore serve`` as bench/daemon.py starts it: the
daemon's own worker count, "auto", unless ``--workers``; with an object tier
on moto's S3 server with ``--object-tier``) on a fresh data directory under
/var/tmp, or uses one at ``--endpoint`` (with ``--admin-token``; ``--pid`` and
``--data-dir`` when it runs on this host). Four tenants (bench/soak_load.py):
sealed and direct ones that drop nothing, a direct one whose quota evicts, a
sealed one whose blocks expire. ``--clients`` loops, together paced to
``--rate`` operations a second, PUT (4 KiB-1 MiB), GET, look up chains,
delete, and batch PUT and GET; every byte read is checked against what its
key was stored with. Meanwhile an operator lowers and raises the quota and
changes the TTL (every ``--churn-s``), flushes and compacts (every
``--maintenance-s``), and sends the supervisor SIGHUP (every ``--sighup-s``),
each first during the warm-up. Deterministic with ``--seed`` (the operations'
choices and the blocks' bytes; not their interleaving).

Sampled every ``--sample-s`` (/proc, per process of the daemon: the
supervisor, the writer, the readers): RSS and anonymous RSS (``RssAnon``),
open descriptors, threads; the data directory's disk use; per operation the
count, p50 and p99 over the interval; requests done, errors and wrong bytes
so far. ``--json`` writes the series, the operator's events and a summary;
``--png`` draws them. ``--check`` exits 1 naming each bound broken
(bench/soak_bounds.py: anonymous RSS grows at most a few MiB a worker past
the warm-up, descriptors and threads flat, 0 errors, 0 wrong bytes), 0 if
none is.

    kvstore-bench soak --minutes 5 --workers 2 --check --json soak.json --png soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from .argtypes import nonneg_float, nonneg_int, positive_float, positive_int
from .fleet_bench import missing_moto
from .harness import Processes, child_pids, percentile_or_none, sigterm_as_exit
from .plots import matplotlib_missing, save_png
from .soak_bounds import Limits, MiB, Verdict, broken, check, warmup_s
from .soak_load import OPS, Keys, Operator, Tally, Workload, pause, tenant_specs

HELP = "a mixed load for minutes or hours: RSS, descriptors, threads, disk, p99 and errors sampled and bounded"
PROG = "kvstore-bench soak"
# What the soak's own daemon sets beside the defaults: bounded memory that the load fills
# within the warm-up. The defaults fill over minutes (the decoded-blocks cache, 256 MiB a
# worker; the writer's residency events kept for SSE resumption, 10,000, about 1 KiB each,
# 5 minutes of the soak's writes and deletes), and a bounded structure filling after the
# warm-up would read as anonymous memory growing.
SOAK_SETTINGS = {"decoded_cache_bytes": str(16 * MiB), "events_backlog": "1000"}
CLIENT_TIMEOUT_S = 60.0  # a call's deadline: only a daemon that stopped answering misses it
READY_AFTER_SIGHUP_S = 10.0
PROGRESS_EVERY_S = 30.0
STATUS_FIELDS = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "Threads": "threads"}


@dataclass
class Target:
    """The daemon soaked: its URL and admin token; its supervisor's pid and
    its data directory where it runs here (None: not sampled)."""

    base: str
    admin_token: str
    pid: int | None
    data_dir: Path | None
    alive: Callable[[], bool]
    exit_status: int | None = None  # once stopped here
    log_problems: list[str] | None = None  # the ERROR and Traceback lines of its log, once stopped here


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=positive_float, default=5.0, help="how long the load runs (default 5)")
    p.add_argument(
        "--workers", type=positive_int, help="the daemon's worker processes (default: its own, workers = auto)"
    )
    p.add_argument(
        "--object-tier", action="store_true", help="give the daemon an object tier on moto's S3 server, started here"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a daemon setting, NAME=VALUE as kvstore serve takes it (repeatable; the soak sets "
        "decoded_cache_bytes=16777216 and events_backlog=1000 unless given)",
    )
    p.add_argument("--endpoint", metavar="URL", help="soak an existing daemon at this URL instead of starting one")
    p.add_argument(
        "--admin-token",
        help="the admin token for --endpoint (default $KVSTORE_ADMIN_TOKEN); tenants soak-ID-* are made",
    )
    p.add_argument("--pid", type=positive_int, help="with --endpoint: its supervisor's pid here, to sample and SIGHUP")
    p.add_argument("--data-dir", type=Path, help="with --endpoint: its data directory here, to sample disk use")
    p.add_argument("--seed", type=nonneg_int, default=1, help="seed of the operations and blocks (default 1)")
    p.add_argument("--clients", type=positive_int, default=8, help="client loops running at once (default 8)")
    p.add_argument("--rate", type=positive_float, default=50.0, help="operations a second, all clients (default 50)")
    p.add_argument(
        "--window", type=positive_int, default=200, help="blocks each keeping tenant holds, older deleted (default 200)"
    )
    p.add_argument("--sample-s", type=positive_float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--churn-s", type=nonneg_float, default=30.0, help="seconds between quota/TTL changes (0: none)")
    p.add_argument("--maintenance-s", type=nonneg_float, default=60.0, help="seconds between flush+compact (0: none)")
    p.add_argument("--sighup-s", type=nonneg_float, default=90.0, help="seconds between SIGHUPs (0: none)")
    p.add_argument("--check", action="store_true", help="exit 1 naming each bound broken (see the description)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the series, events and summary as JSON")
    p.add_argument("--png", type=Path, metavar="PATH", help="draw RSS, fds, threads, p99 and errors (needs matplotlib)")
    return p


# -- sampling ----------------------------------------------------------------------------------


def roles(pid: int) -> dict[str, int]:
    """The daemon's processes by role: alone, "worker"; with workers, the
    "supervisor", its first child the "writer", the others "reader-N"."""
    kids = child_pids(pid)
    if not kids:
        return {"worker": pid}
    return {"supervisor": pid, "writer": kids[0], **{f"reader-{i}": k for i, k in enumerate(kids[1:], 1)}}


def process_figures(pid: int) -> dict[str, int] | None:
    """A process's pid, RSS, anonymous and file RSS (bytes), threads, open
    descriptors and how many of them are sockets (None: it is gone)."""
    out = {"pid": pid}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in STATUS_FIELDS:
                number = int(value.split()[0])
                out[STATUS_FIELDS[name]] = number * 1024 if value.strip().endswith("kB") else number
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError):
        return None
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    out["fds"], out["sockets"] = len(fds), sockets
    return out


def disk_used(root: Path) -> int:
    """Bytes the files under ``root`` take on disk (allocated blocks, as du counts)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def proc_sample(target: Target) -> dict[str, Any]:
    """What /proc and the disk say now (blocking: run on a thread)."""
    workers: dict[str, dict[str, int]] = {}
    if target.pid is not None:
        for role, pid in roles(target.pid).items():
            figures = process_figures(pid)
            if figures is not None:
                workers[role] = figures
    disk = disk_used(target.data_dir) if target.data_dir is not None else None
    return {"workers": workers, "disk_bytes": disk}


_METRIC = re.compile(r"^(kvstore_decoded_cache_bytes|kvstore_errors_total|kvstore_corruption_total)\b\S*\s+(\S+)$")


def metric_sums(text: str) -> dict[str, float]:
    """The sums over labels of the few daemon series a soak records."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def interval_ops(latencies: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per operation: how many, p50 and p99 in ms (null when none)."""

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 2)

    return {
        op: {"n": len(v), "p50_ms": ms(percentile_or_none(v, 0.5)), "p99_ms": ms(percentile_or_none(v, 0.99))}
        for op, v in latencies.items()
    }


class Sampler:
    """Every ``every`` seconds, a sample of the daemon and of the load."""

    def __init__(self, target: Target, tally: Tally, http: Any, started: float) -> None:
        self.target = target
        self.tally = tally
        self.http = http
        self.started = started
        self.samples: list[dict[str, Any]] = []
        self.all_latencies: dict[str, list[float]] = {op: [] for op in OPS}

    async def take(self) -> dict[str, Any]:
        t = time.monotonic() - self.started
        sample: dict[str, Any] = {"t": round(t, 2), **await asyncio.to_thread(proc_sample, self.target)}
        latencies = self.tally.interval()
        for op, v in latencies.items():
            self.all_latencies[op] += v
        sample["ops"] = interval_ops(latencies)
        sample["requests"] = sum(self.tally.done.values())
        sample["errors"] = self.tally.total_errors
        sample["wrong_bytes"] = self.tally.wrong_bytes
        sample["daemon"] = await self._metrics()
        self.samples.append(sample)
        return sample

    async def _metrics(self) -> dict[str, float] | None:
        try:
            headers = {"Authorization": f"Bearer {self.target.admin_token}"}
            async with self.http.get(self.target.base + "/metrics", headers=headers) as r:
                return metric_sums(await r.text()) if r.status == 200 else None
        except Exception:  # noqa: BLE001 - a figure missing, not a failure of the soak (the load's errors count those)
            return None

    async def run(self, every: float, stop: asyncio.Event) -> None:
        last_print = 0.0
        while not stop.is_set():
            sample = await self.take()
            if not self.target.alive():
                self.tally.error("operator", f"the daemon exited at {sample['t']:.0f} s")
                stop.set()
            if sample["t"] - last_print >= PROGRESS_EVERY_S:
                last_print = sample["t"]
                print(progress_line(sample), file=sys.stderr, flush=True)
            await pause(stop, every)


def progress_line(sample: dict[str, Any]) -> str:
    anon = " ".join(f"{r} {w['rss_anon'] / MiB:.0f}" for r, w in sample["workers"].items() if "rss_anon" in w)
    return f"  {sample['t']:6.0f} s  {sample['requests']} requests, {sample['errors']} errors" + (
        f"; RssAnon MiB: {anon}" if anon else ""
    )


# -- the run -------------------------------------------------------------------------------------


async def admin_call(http: Any, target: Target, method: str, path: str, doc: dict[str, Any] | None) -> tuple[int, Any]:
    """An admin API call: (status, its JSON or text)."""
    headers = {"Authorization": f"Bearer {target.admin_token}"}
    async with http.request(method, target.base + path, json=doc, headers=headers) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def hangup(http: Any, target: Target, pid: int) -> float | None:
    """SIGHUP to the supervisor, then the seconds until /readyz answers 200 (None: not within 10 s)."""
    os.kill(pid, signal.SIGHUP)
    t0 = time.monotonic()
    while time.monotonic() - t0 < READY_AFTER_SIGHUP_S:
        with contextlib.suppress(Exception):
            async with http.get(target.base + "/readyz") as r:
                if r.status == 200:
                    return round(time.monotonic() - t0, 3)
        await asyncio.sleep(0.1)
    return None


async def soak(args: argparse.Namespace, target: Target, prefix: str) -> dict[str, Any]:
    """The load, the operator and the sampler for ``--minutes``; the document --json writes."""
    import aiohttp
    from kvstore_client import AsyncClient

    duration = args.minutes * 60
    warmup = warmup_s(duration)
    tally = Tally()
    specs = tenant_specs(prefix)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        admin = partial(admin_call, http, target)
        tokens = {}
        for spec in specs:
            status, body = await admin(
                "POST", "/v1/admin/tenants", {"name": spec.name, "policy": spec.policy, **spec.fields}
            )
            if status != 201:
                raise RuntimeError(f"creating tenant {spec.name!r}: HTTP {status}: {str(body)[:300]}")
            tokens[spec.name] = body["token"]
        clients = {
            name: AsyncClient(
                target.base,
                token,
                strict=True,  # every failure raises, to be tallied
                retries=0,  # and none is hidden by a retry that succeeded
                timeout=CLIENT_TIMEOUT_S,
                pool_size=-(-args.clients // len(specs)),  # at most --clients connections in all
            )
            for name, token in tokens.items()
        }
        pid = target.pid
        operator = Operator(
            admin,
            partial(hangup, http, target, pid) if pid is not None else None,
            tally,
            quota_tenant=specs[2].name,
            ttl_tenant=specs[3].name,
            churn_s=args.churn_s,
            maintenance_s=args.maintenance_s,
            sighup_s=args.sighup_s,
        )
        workload = Workload([Keys(s, args.window) for s in specs], clients, args.seed, tally)
        stop = asyncio.Event()
        started = time.monotonic()
        sampler = Sampler(target, tally, http, started)
        try:
            tasks = [asyncio.create_task(workload.run(i, args.rate / args.clients, stop)) for i in range(args.clients)]
            tasks.append(asyncio.create_task(operator.run(warmup, started, stop)))
            tasks.append(asyncio.create_task(sampler.run(args.sample_s, stop)))
            await pause(stop, duration)
            stop.set()
            await asyncio.gather(*tasks)
            end = time.monotonic() - started
            await sampler.take()
        finally:
            for c in clients.values():
                await c.close()
            if prefix:  # tenants made on someone else's daemon go again
                for spec in specs:
                    with contextlib.suppress(Exception):
                        await admin("DELETE", f"/v1/admin/tenants/{spec.name}", None)
    return report(args, tally, sampler, operator.events, warmup, end)


def worker_series(samples: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """role -> figure -> [(t, value)] from the samples."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for s in samples:
        for role, figures in s["workers"].items():
            for name, value in figures.items():
                out.setdefault(role, {}).setdefault(name, []).append((s["t"], float(value)))
    return out


def report(
    args: argparse.Namespace, tally: Tally, sampler: Sampler, events: list[dict[str, Any]], warmup: float, end: float
) -> dict[str, Any]:
    """The JSON document: settings, series, events and the summary with the bounds' verdicts."""
    series = worker_series(sampler.samples)
    verdicts = check(
        series, tally.total_errors, tally.wrong_bytes, warmup, end, Limits.for_run(args.clients, args.object_tier)
    )
    after = [s for s in sampler.samples if s["t"] >= warmup]
    workers = {}
    for role, figures in series.items():
        late = [v for t, v in figures.get("rss_anon", []) if t >= warmup]
        workers[role] = {
            "rss_anon_mib": _span(late, MiB),
            "rss_mib": _span([v for t, v in figures.get("rss", []) if t >= warmup], MiB),
            "fds": _span([v for t, v in figures.get("fds", []) if t >= warmup], 1),
            "threads": _span([v for t, v in figures.get("threads", []) if t >= warmup], 1),
        }
    disks = [s["disk_bytes"] for s in after if s["disk_bytes"] is not None]
    summary = {
        "minutes": args.minutes,
        "seconds": round(end, 1),
        "warmup_s": round(warmup, 1),
        "requests": sum(tally.done.values()),
        "ops": interval_ops(sampler.all_latencies),
        "hits": tally.hits,
        "misses": tally.misses,
        "errors": tally.total_errors,
        "errors_by_kind": tally.errors,
        "error_messages": tally.messages,
        "wrong_bytes": tally.wrong_bytes,
        "workers": workers,
        "disk_mib": _span(disks, MiB),
        "bounds": [v.as_dict() for v in verdicts],
        "ok": not broken(verdicts),
    }
    settings = {k: v for k, v in vars(args).items() if k not in ("admin_token",)}
    return {
        "settings": json.loads(json.dumps(settings, default=str)),
        "samples": sampler.samples,
        "events": events,
        "summary": summary,
    }


def _span(values: list[float], scale: float) -> dict[str, float] | None:
    """First, smallest, largest and last of ``values`` after the warm-up, in ``scale`` units."""
    if not values:
        return None
    return {
        k: round(v / scale, 1)
        for k, v in (("first", values[0]), ("min", min(values)), ("max", max(values)), ("last", values[-1]))
    }


# -- the daemon -----------------------------------------------------------------------------------


@contextlib.contextmanager
def local_daemon(args: argparse.Namespace) -> Iterator[Target]:
    """``kvstore serve`` on a fresh directory under /var/tmp (with moto's S3
    server for ``--object-tier``), stopped and removed afterwards."""
    from .daemon import Kvstore

    root = Path(tempfile.mkdtemp(prefix="kvstore-soak-", dir="/var/tmp"))
    procs = Processes()
    moto = None
    try:
        settings = {**SOAK_SETTINGS, **dict(s.split("=", 1) for s in args.set)}
        aws: dict[str, str] = {}
        if args.object_tier:
            from . import moto_s3

            moto, url = moto_s3.start()
            moto_s3.ensure_bucket(url, "soak")
            settings |= {"s3_bucket": "soak", "s3_endpoint": url}
            aws = {
                "AWS_ACCESS_KEY_ID": moto_s3.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": moto_s3.SECRET_KEY,
                "AWS_DEFAULT_REGION": moto_s3.REGION,
                "AWS_EC2_METADATA_DISABLED": "true",
            }
        kv = Kvstore(procs, root, settings=settings)
        kv.env.update(aws)
        kv.start(args.workers, timeout=120)
        proc = kv.proc
        assert proc is not None
        target = Target(kv.base, kv.admin_token, proc.pid, root / "data", lambda: proc.poll() is None)
        try:
            yield target
        finally:
            kv.stop()
            target.exit_status = proc.returncode
            target.log_problems = log_problems(kv.log)
    finally:
        procs.stop_all()
        if moto is not None:
            moto.stop()
        shutil.rmtree(root, ignore_errors=True)


def endpoint_target(args: argparse.Namespace, token: str) -> Target:
    pid = args.pid

    def alive() -> bool:
        return pid is None or Path(f"/proc/{pid}").exists()

    return Target(args.endpoint.rstrip("/"), token, pid, args.data_dir, alive)


def log_problems(log: Path, limit: int = 10) -> list[str]:
    """The daemon log's ERROR and Traceback lines (the first ``limit``)."""
    if not log.exists():
        return []
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if " ERROR " in ln or "Traceback" in ln]
    return lines[:limit]


# -- output ------------------------------------------------------------------------------------------


def print_summary(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    print(
        f"soak: {s['seconds']:.0f} s (warm-up {s['warmup_s']:.0f} s), {s['requests']} requests, "
        f"{s['hits']} hits, {s['misses']} misses, {s['errors']} errors, {s['wrong_bytes']} wrong bytes"
    )
    for op, f in s["ops"].items():
        print(f"  {op:<9} {f['n']:>7}  p50 {f['p50_ms']} ms  p99 {f['p99_ms']} ms")
    for role, w in s["workers"].items():
        anon = w["rss_anon_mib"] or {}
        print(f"  {role:<10} RssAnon MiB {anon.get('min')}..{anon.get('max')}  fds {w['fds']}  threads {w['threads']}")
    if s["disk_mib"]:
        print(f"  disk MiB {s['disk_mib']}")
    for v in s["bounds"]:
        verdict = Verdict(**v)
        print(f"  {'ok    ' if verdict.ok else 'BROKEN'} {verdict.line()}")
    for m in s["error_messages"][:5]:
        print(f"  error: {m}")


def draw(doc: dict[str, Any], path: Path) -> None:
    """Six panels over time: anonymous RSS per worker, descriptors, threads, p99 per operation,
    errors so far, disk used; the warm-up's end and the operator's events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, warmup = doc["samples"], doc["summary"]["warmup_s"]
    series = worker_series(samples)
    fig, axes = plt.subplots(3, 2, figsize=(13, 11), sharex=True)
    panels = [("rss_anon", "RssAnon (MiB)", MiB), ("fds", "open descriptors", 1), ("threads", "threads", 1)]
    for ax, (name, title, scale) in zip(axes.flat[:3], panels, strict=True):
        for role, figures in series.items():
            pts = figures.get(name, [])
            ax.plot([t for t, _ in pts], [v / scale for _, v in pts], label=role)
        ax.set_title(title)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for op in OPS:
        pts = [(s["t"], s["ops"][op]["p99_ms"]) for s in samples if s["ops"][op]["p99_ms"] is not None]
        ax.plot([t for t, _ in pts], [v for _, v in pts], label=op)
    ax.set_yscale("log")
    ax.set_title("p99 per operation over each interval (ms)")
    ax.legend(fontsize=8)
    axes.flat[4].plot([s["t"] for s in samples], [s["errors"] for s in samples], label="errors")
    axes.flat[4].plot([s["t"] for s in samples], [s["wrong_bytes"] for s in samples], label="wrong bytes")
    axes.flat[4].set_title("errors and wrong bytes so far")
    axes.flat[4].legend(fontsize=8)
    disk = [(s["t"], s["disk_bytes"] / MiB) for s in samples if s["disk_bytes"] is not None]
    axes.flat[5].plot([t for t, _ in disk], [v for _, v in disk])
    axes.flat[5].set_title("data directory on disk (MiB)")
    for ax in axes.flat:
        ax.axvline(warmup, color="grey", linestyle="--", linewidth=0.8)
        for e in doc["events"]:
            if e["what"] in ("flush", "SIGHUP"):
                ax.axvline(e["t"], color="red" if e["what"] == "SIGHUP" else "green", alpha=0.3, linewidth=0.8)
    for ax in axes[-1]:
        ax.set_xlabel("seconds (dashed: warm-up's end; green: flush+compact; red: SIGHUP)")
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    token = args.admin_token or os.environ.get("KVSTORE_ADMIN_TOKEN", "")
    if args.endpoint and not token:
        parser.error("argument --endpoint: needs --admin-token (or $KVSTORE_ADMIN_TOKEN)")
    for flag, value in (("--pid", args.pid), ("--data-dir", args.data_dir)):
        if value is not None and not args.endpoint:
            parser.error(f"argument {flag}: only with --endpoint (a daemon started here is sampled anyway)")
    for flag, value in (("--workers", args.workers), ("--object-tier", args.object_tier), ("--set", args.set)):
        if value and args.endpoint:
            parser.error(f"argument {flag}: not with --endpoint (the daemon there is already configured)")
    for s in args.set:
        if not re.fullmatch(r"[a-z0-9_]+=.*", s):
            parser.error(f"argument --set: {s!r}: expected NAME=VALUE, e.g. decoded_cache_bytes=0")
    if args.png and (why := matplotlib_missing()):
        parser.error(f"argument --png: {why}")
    if args.object_tier and (why := missing_moto(prog=PROG)):
        print(why, file=sys.stderr)  # before anything starts
        return 2
    with sigterm_as_exit():
        if args.endpoint:
            target = endpoint_target(args, token)
            doc = asyncio.run(soak(args, target, f"soak-{uuid.uuid4().hex[:8]}-"))
        else:
            with local_daemon(args) as target:
                doc = asyncio.run(soak(args, target, ""))
    doc["summary"]["daemon_exit_status"] = target.exit_status
    doc["summary"]["daemon_log_problems"] = target.log_problems
    print_summary(doc)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        draw(doc, args.png)
    if args.check:
        failed = [Verdict(**v) for v in doc["summary"]["bounds"] if not v["ok"]]
        for v in failed:
            print(f"{PROG}: bound broken: {v.line()}", file=sys.stderr)
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
