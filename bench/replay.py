"""``kvstore-bench replay``: a request trace (Mooncake's format) replayed through the client library.

Each request of the trace (``trace.py``: its arrival time and its chain of
512-token prefix blocks) becomes what an engine with kvstore under it does:

1. a prefix lookup of its chain (``AsyncClient.lookup`` with
   ``tokens_per_block``, counted by the daemon in tokens);
2. a load of the prefix found (``get_many_into``, 64 MiB a call at most),
   each block's bytes compared with the bytes stored under it
   (``wrong_bytes``); the blocks loaded whole from the start of the chain
   are the request's hit;
3. stores of the rest of the chain (``put_many_detail``; a block stored
   already is a no-op that the daemon counts as a use; with
   ``--admit-after N`` the daemon stores a block only at its N-th offer,
   and the offers it declines are counted).

Requests start at ``--speed`` times the trace's pace (0 or ``max``: as soon
as one of the ``--concurrency`` slots is free), in the trace's order. Block
``i`` of the trace is stored under ``bench-<run id>-<i>``: its bytes are a
slice of the real KV samples (the package's ``data/kv``) chosen by ``i``,
stamped with ``i`` and the run, so that a block read under another block's
key is wrong bytes. Blocks are the model's KV cache of 512 tokens
(``--model``, as ``kvstore-bench size`` computes it) or ``--block-bytes``.

The replay itself is ``replayer.py``. The figures (``replay_report.py``) set the hit ratio measured against three
caches run over the same requests (``trace.py``: unbounded, LRU and Belady
at the blocks the tenant held at the end) and split it by where the daemon
served it. The client cannot tell that per block, so the split comes from
the daemon's ``kvstore_tier_reads_total`` (reads of records only in the
object tier, G4) over the run, against the blocks loaded: the rest of the
hits were served from local disk or memory (G3).

A daemon started here (no ``--endpoint``) runs on a fresh data directory with
one worker and one tenant (``--policy``, ``--quota``, ``--admit-after``,
``--set``) and is removed at the end; against ``--endpoint`` the run's keys are deleted at the
end unless ``--keep``, and the tier split counts every tenant of that daemon.

With ``--fleet`` the daemons are a fleet (docs/fleet.md): ``--endpoint``'s
URLs are its seeds, the client (``fleet=True``) reads the members from
``GET /v1/fleet`` and places each key on its owner; or ``--nodes N`` starts
N nodes here on one bucket of moto's S3 server (``fleet_bench.local_fleet``),
one worker each, the tenant created on node 0 and served by every node before
the replay starts. What is read from the daemons then covers every member
(``replayer.py``): the ``/metrics`` counters summed, the blocks held listed on
each, the run's keys deleted on each, and a started fleet's CPU summed over
its nodes' process trees.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import QUOTA_EVICTION

from .argtypes import dtype_arg, model_arg, positive_float, positive_int
from .fleet_bench import missing_moto
from .harness import sigterm_as_exit, tree_cpu_seconds
from .models import ModelGeometry, resolve_model
from .plots import matplotlib_missing
from .replay_report import Figures, compare_table, figures, render, write_compared_json, write_json, write_png
from .replayer import ReplayOptions, replay
from .run import Leftovers, clean_endpoint
from .sizing import fmt_bytes, kv_bytes_per_block
from .trace import MOONCAKE_TOKENS_PER_BLOCK, NAMED, SYNTHETIC, Request, load_trace, references, shape, trace_path

PROG = "kvstore-bench replay"
DEFAULT_MODEL = "Llama-3.1-8B"
DAEMON_MAX_BLOCK = 64 << 20  # the daemon's default max_block_size
MIN_BLOCK_BYTES = 64
# A fleet started here: a node is declared dead after this long without a heartbeat (the fleet's default
# is 3 s at 1 s heartbeats), so that a node slowed by the replay on a small machine is not fenced mid-run.
FLEET_HEARTBEAT_S = 1.0
FLEET_DEAD_AFTER_S = 10.0
FLEET_TENANT_WAIT_S = 30.0


# -- options ----------------------------------------------------------------------------


def _size(text: str) -> int:
    """A byte count: digits, or with a unit as the daemon's settings take them (16KiB, 64MiB)."""
    from kvstore.config import parse_size
    from kvstore.errors import ConfigError

    try:
        value = int(parse_size("size", text))
    except (ConfigError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes such as 16384 or 16KiB") from None
    if value < MIN_BLOCK_BYTES:
        raise argparse.ArgumentTypeError(f"{value} must be at least {MIN_BLOCK_BYTES} bytes")
    return value


def _speed(text: str) -> float:
    """A factor of the trace's pace; 0 or 'max': as fast as the slots allow."""
    if text.strip().lower() == "max":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'max'") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be positive (or 0 / 'max': as fast as possible)")
    return value


def _admit_after(text: str) -> int:
    """``--admit-after``: 1 to MAX_ADMIT_AFTER, as the tenant setting takes it."""
    from kvstore.engine.api import MAX_ADMIT_AFTER

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_ADMIT_AFTER:
        raise argparse.ArgumentTypeError(f"{value} must be 1 to {MAX_ADMIT_AFTER}")
    return value


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in QUOTA_EVICTION]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected policies among {', '.join(QUOTA_EVICTION)}")
    return names


def _check_compare(args: argparse.Namespace, settings: dict[str, str], error: Callable[[str], Any]) -> None:
    if not args.compare:
        return
    if args.endpoint or args.nodes:
        error("argument --compare: only for one daemon this command starts (not with --endpoint or --nodes)")
    if args.quota is None:
        error("argument --compare: needs --quota (without a quota no block is evicted)")
    if "quota_eviction" in settings:
        error("argument --compare: sets quota_eviction itself; drop --set quota_eviction")
    if args.png is not None:
        error("argument --compare: --png plots one replay; give it without --compare")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--trace",
        type=trace_path,
        default=SYNTHETIC,
        metavar="FILE|NAME",
        help="a trace in Mooncake's JSONL format (gzipped if named *.gz), or of prompts' token_ids chained here "
        f"in blocks of --tokens-per-block; or one shipped with the package: {', '.join(NAMED)} "
        "(default: synthetic, Mooncake's synthetic trace)",
    )
    ap.add_argument("--requests", type=positive_int, help="replay only the first N requests (default: all)")
    ap.add_argument(
        "--model",
        type=model_arg,
        default=resolve_model(DEFAULT_MODEL),
        help=f"the model whose KV cache a block holds: a preset name or 'layers=N,kv_heads=N,head_dim=N' "
        f"(default {DEFAULT_MODEL}); sizes the blocks and the prefill figures",
    )
    ap.add_argument(
        "--dtype", type=dtype_arg, help="the KV-cache dtype, overriding the model's (fp8, fp16, bf16, fp32)"
    )
    ap.add_argument(
        "--tokens-per-block",
        type=positive_int,
        default=MOONCAKE_TOKENS_PER_BLOCK,
        help=f"tokens per hash id of the trace (default {MOONCAKE_TOKENS_PER_BLOCK}, Mooncake's block)",
    )
    ap.add_argument(
        "--block-bytes",
        type=_size,
        help="bytes stored per block, instead of the model's KV cache of one block (e.g. 16KiB: a scaled-down "
        "run that fits a small machine; the hit ratios do not depend on it)",
    )
    ap.add_argument(
        "--speed",
        type=_speed,
        default=0.0,
        help="replay at this many times the trace's pace (1: its own timestamps); 0 or 'max' (the default): "
        "each request as soon as a slot is free",
    )
    ap.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at most (default 4)")
    ap.add_argument(
        "--endpoint",
        metavar="URL[,URL...]",
        help="replay against an existing daemon at this URL instead of starting one (with --fleet: one or more "
        "comma-separated URLs, the seeds of a fleet); the run's keys (bench-<run id>-*) are deleted at the "
        "end, on every member of a fleet, unless --keep",
    )
    ap.add_argument(
        "--fleet",
        action="store_true",
        help="the daemons are a fleet: with --endpoint, its seeds (the client reads the members from "
        "GET /v1/fleet and places each key on its owner); with --nodes N, a fleet of N nodes started here "
        "on one S3 bucket (moto's server). Blocks held, /metrics counters and the cleanup cover every member",
    )
    ap.add_argument(
        "--nodes",
        type=positive_int,
        metavar="N",
        help="with --fleet and no --endpoint: the nodes of the fleet started here (at least 2, one worker each)",
    )
    ap.add_argument("--token", help="the tenant token for --endpoint (default $KVSTORE_TOKEN)")
    ap.add_argument(
        "--metrics-token",
        help="with --endpoint: the bearer token for its /metrics (every member's, for a fleet), where it asks "
        "for one (default $KVSTORE_METRICS_TOKEN)",
    )
    ap.add_argument("--keep", action="store_true", help="with --endpoint: leave the run's blocks in the tenant")
    ap.add_argument(
        "--policy",
        choices=("sealed", "direct"),
        help="the started daemon's (or fleet's) tenant policy (default sealed)",
    )
    ap.add_argument(
        "--quota",
        type=_size,
        help="the started daemon's tenant quota in bytes (e.g. 64MiB): its least recently used blocks go "
        "(a started fleet: each node's, on its own shard)",
    )
    ap.add_argument(
        "--admit-after",
        type=_admit_after,
        default=1,
        metavar="N",
        help="the started daemon's (or fleet's) tenant stores a block only at its N-th offer within an hour "
        "(its admit_after, 1 to 16; default 1: every block at its first)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the started daemon (every node of a started fleet), passed as its KVSTORE_ variable "
        "(repeatable; e.g. tier_dir=/mnt/g4)",
    )
    ap.add_argument(
        "--prefill-tps",
        type=positive_float,
        help="the prefill rate in tokens/s, for the prefill time the hits save (none by default: no preset has one)",
    )
    ap.add_argument(
        "--compare",
        type=_policies,
        metavar="POLICIES",
        help=f"replay once per quota eviction policy, comma-separated ({', '.join(QUOTA_EVICTION)}), each on a "
        "fresh daemon started here with --quota, and print one table of them (and --json them all)",
    )
    ap.add_argument("--timeout", type=positive_float, default=30.0, help="deadline of each call, s (default 30)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is no TTY)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every figure and the time series as JSON")
    ap.add_argument(
        "--png",
        type=Path,
        metavar="PATH",
        help="write a chart of the hit ratio and the latencies over the run (needs matplotlib)",
    )
    return ap


def _settings(items: Sequence[str], error: Callable[[str], Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            error(f"argument --set: {item!r}: expected NAME=VALUE")
        out[name.strip().lower()] = value
    return out


def _endpoints(text: str, error: Callable[[str], Any]) -> tuple[str, ...]:
    """``--endpoint``'s comma-separated URLs, each http:// or https://, none twice."""
    urls = tuple(u.strip() for u in text.split(","))
    for url in urls:
        if not url.startswith(("http://", "https://")):
            error(f"argument --endpoint: {url!r} is not an http:// or https:// URL")
    if len(set(urls)) < len(urls):
        error(f"argument --endpoint: {text!r} names a URL twice")
    return urls


def _check_fleet(args: argparse.Namespace, endpoints: tuple[str, ...], error: Callable[[str], Any]) -> None:
    if len(endpoints) > 1 and not args.fleet:
        error(
            f"argument --endpoint: {len(endpoints)} URLs, but one daemon takes one: several are the seeds of a "
            "fleet (add --fleet)"
        )
    if args.nodes is not None and not args.fleet:
        error("argument --nodes: only with --fleet (the nodes of a fleet started here)")
    if not args.fleet:
        return
    if not endpoints and args.nodes is None:
        error(
            "argument --fleet: needs --endpoint URL[,URL...] (a running fleet's seeds) or --nodes N (a fleet "
            "started here)"
        )
    if endpoints and args.nodes is not None:
        error("argument --nodes: only for a fleet this command starts (not with --endpoint)")
    if args.nodes is not None:
        if args.nodes < 2:
            error(f"argument --nodes: a fleet started here needs at least 2 nodes, got {args.nodes}")
        if why := missing_moto(prog="argument --nodes"):
            error(why)  # now, before anything starts


def _check_endpoint(args: argparse.Namespace, error: Callable[[str], Any]) -> tuple[str, ...]:
    """The checked ``--endpoint`` URLs (none: daemons started here)."""
    endpoints = _endpoints(args.endpoint, error) if args.endpoint is not None else ()
    _check_fleet(args, endpoints, error)
    if not endpoints:
        for opt, given in (("--token", args.token), ("--metrics-token", args.metrics_token), ("--keep", args.keep)):
            if given:
                error(f"argument {opt}: only with --endpoint")
        return endpoints
    if not (args.token or os.environ.get("KVSTORE_TOKEN")):
        error("argument --token: required with --endpoint (or set KVSTORE_TOKEN)")
    for opt, given in (
        ("--policy", args.policy),
        ("--quota", args.quota),
        ("--admit-after", args.admit_after != 1),
        ("--set", args.set),
    ):
        if given:
            error(f"argument {opt}: only for a daemon this command starts (not with --endpoint)")
    return endpoints


def build_options(args: argparse.Namespace, error: Callable[[str], Any]) -> ReplayOptions:
    """Check and complete the parsed options; ``error`` (parser.error) exits 2."""
    endpoints = _check_endpoint(args, error)
    model: ModelGeometry = args.model.with_dtype(args.dtype) if args.dtype else args.model
    if args.png is not None and (why := matplotlib_missing()) is not None:
        error(f"argument --png: {why}")  # now, not after the replay
    if not args.trace.is_file():
        error(f"argument --trace: {args.trace} is not a file")
    settings = _settings(args.set, error)
    _check_compare(args, settings, error)
    return ReplayOptions(
        trace=args.trace,
        requests=args.requests,
        model=model,
        tokens_per_block=args.tokens_per_block,
        block_bytes=args.block_bytes or kv_bytes_per_block(model, args.tokens_per_block),
        speed=args.speed,
        concurrency=args.concurrency,
        endpoints=endpoints,
        fleet=args.fleet,
        nodes=args.nodes,
        token=args.token or os.environ.get("KVSTORE_TOKEN"),
        metrics_token=args.metrics_token or os.environ.get("KVSTORE_METRICS_TOKEN"),
        keep=args.keep,
        policy=args.policy or "sealed",
        quota=args.quota,
        admit_after=args.admit_after,
        settings=settings,
        prefill_tps=args.prefill_tps or model.prefill_tokens_per_s_8gpu,
        timeout=args.timeout,
        progress=not args.no_progress and sys.stderr.isatty(),
        json_path=args.json,
        png_path=args.png,
        compare=args.compare or (),
    )


# -- main -----------------------------------------------------------------------------------


def say(msg: str) -> None:
    print(msg, flush=True)


def _started_settings(opts: ReplayOptions) -> dict[str, str]:
    settings = dict(opts.settings)
    if opts.quota is not None:
        settings["default_quota_bytes"] = str(opts.quota)
    if opts.block_bytes > DAEMON_MAX_BLOCK and "max_block_size" not in settings:
        settings["max_block_size"] = str(opts.block_bytes)
    return settings


def _check_space(opts: ReplayOptions, unique_blocks: int, where: Path, copies: int = 1, what: str = "") -> None:
    """Daemons started here hold every block of the replay (or their quota's
    worth), ``copies`` times on ``where`` (a fleet's bucket is a second copy):
    refused up front when that cannot fit, rather than a full disk mid-run."""
    need = unique_blocks * opts.block_bytes
    if opts.quota is not None:
        need = min(need, opts.quota * (opts.nodes or 1))
    need = int(need * copies * 1.1) + (256 << 20)
    free = shutil.disk_usage(where).free
    if free < need:
        raise ValueError(
            f"argument --block-bytes: {unique_blocks:,} blocks of {fmt_bytes(opts.block_bytes)} need about "
            f"{fmt_bytes(need)}{what}, {where} has {fmt_bytes(free)} free: scale the blocks down (e.g. --block-bytes "
            "16KiB), replay fewer --requests or set a --quota"
        )


@dataclass(slots=True)
class Target:
    """What the replay runs against: ``endpoints`` (one daemon, or a fleet's
    seeds), the tenant's ``token``, and the pids of the daemons started here
    (none: existing ones), whose process trees' CPU is counted."""

    endpoints: list[str]
    token: str
    pids: list[int] = field(default_factory=list)

    def cpu_seconds(self) -> float | None:
        return sum(tree_cpu_seconds(p) for p in self.pids) if self.pids else None


@contextlib.contextmanager
def _started_daemon(opts: ReplayOptions, unique_blocks: int) -> Iterator[Target]:
    from .daemon import daemon

    _check_space(opts, unique_blocks, Path("/var/tmp"))
    tenant = {"admit_after": opts.admit_after} if opts.admit_after > 1 else None
    with daemon(_started_settings(opts), policy=opts.policy, tenant=tenant) as d:
        admits = f", admit_after {opts.admit_after}" if tenant else ""
        say(f"started kvstore on {d.base} (data dir {d.root}/data), tenant 'bench', policy {opts.policy}{admits}")
        yield Target([d.base], d.token, [d.proc.pid])


@contextlib.contextmanager
def _started_fleet(opts: ReplayOptions, unique_blocks: int) -> Iterator[Target]:
    """``--nodes`` daemons as a fleet on one bucket of moto's server (in this
    process), one worker each and ``--set``'s settings; the tenant created on
    node 0, and served by every node before the replay."""
    from .fleet_bench import local_fleet

    nodes = opts.nodes or 2
    same_disk = os.stat("/var/tmp").st_dev == os.stat(tempfile.gettempdir()).st_dev
    bucket = " (the nodes' disks and the bucket's copy: moto spills objects to temporary files)"
    _check_space(opts, unique_blocks, Path("/var/tmp"), 2 if same_disk else 1, bucket if same_disk else "")
    if not same_disk:
        _check_space(opts, unique_blocks, Path(tempfile.gettempdir()), 1, " (the bucket's copy)")
    settings = {"workers": "1", **_started_settings(opts)}
    with local_fleet(
        nodes,
        "kvstore-bench-replay-fleet-",
        PROG,
        workers=None,  # settings' workers
        heartbeat_s=FLEET_HEARTBEAT_S,
        dead_after_s=FLEET_DEAD_AFTER_S,
        settings=settings,
        flags=["--compact-interval-s", "0"],
    ) as fleet:
        tenant = {"admit_after": opts.admit_after} if opts.admit_after > 1 else None
        token = fleet.nodes[0].create_tenant("bench", opts.policy, tenant)
        fleet.wait_tenant(token, FLEET_TENANT_WAIT_S, PROG)
        admits = f", admit_after {opts.admit_after}" if tenant else ""
        say(
            f"started a fleet of {nodes} kvstore nodes on {', '.join(fleet.bases)} (one S3 bucket, moto's server), "
            f"tenant 'bench', policy {opts.policy}{admits}"
        )
        yield Target(list(fleet.bases), token, [n.proc.pid for n in fleet.nodes if n.proc is not None])


@contextlib.contextmanager
def _target(opts: ReplayOptions, unique_blocks: int) -> Iterator[Target]:
    if opts.existing:
        yield Target(list(opts.endpoints), opts.token or "")
    elif opts.fleet:
        with _started_fleet(opts, unique_blocks) as target:
            yield target
    else:
        with _started_daemon(opts, unique_blocks) as target:
            yield target


def execute(opts: ReplayOptions) -> int:
    try:
        requests = load_trace(opts.trace, opts.requests, opts.tokens_per_block)
    except ValueError as e:
        raise ValueError(f"argument --trace: {e}") from None
    cut = shape(requests)
    run_id = os.urandom(4).hex()
    say(
        f"{PROG}: {opts.trace.name}, {cut.requests:,} requests, {cut.tokens:,} input tokens, "
        f"{cut.unique_blocks:,} unique blocks of {fmt_bytes(opts.block_bytes).split(' = ')[-1]}"
    )
    if opts.compare:
        return _compared(opts, requests)
    figs, cleaned = _replayed(opts, requests, run_id)
    say(render(figs))
    if opts.json_path is not None:
        write_json(opts.json_path, figs)
        say(f"wrote {opts.json_path}")
    if opts.png_path is not None:
        write_png(opts.png_path, figs)
        say(f"wrote {opts.png_path}")
    return 0 if cleaned is not None else 1


def _compared(opts: ReplayOptions, requests: Sequence[Request]) -> int:
    """``--compare``: the same requests through a fresh daemon per policy."""
    runs: dict[str, Figures] = {}
    for policy in opts.compare:
        say(f"-- quota_eviction = {policy}")
        one = dataclasses.replace(opts, settings={**opts.settings, "quota_eviction": policy}, compare=())
        runs[policy], _ = _replayed(one, requests, os.urandom(4).hex())
        say(render(runs[policy]))
        say("")
    say(compare_table(runs))
    if opts.json_path is not None:
        write_compared_json(opts.json_path, runs)
        say(f"wrote {opts.json_path}")
    return 0


def _replayed(opts: ReplayOptions, requests: Sequence[Request], run_id: str) -> tuple[Figures, str | None]:
    """One replay of ``requests`` and its figures, with what cleaning an
    existing endpoint said (None: it failed)."""
    cut = shape(requests)
    cleaned: str | None = ""
    with _target(opts, cut.unique_blocks) as target:
        cpu0 = target.cpu_seconds()
        try:
            done = asyncio.run(replay(opts, requests, target.endpoints, target.token, run_id))
        finally:
            if opts.existing:
                left = Leftovers(
                    tuple(target.endpoints), target.token, run_id, opts.keep, opts.timeout, opts.concurrency, opts.fleet
                )
                cleaned = clean_endpoint(left, PROG)
        cpu1 = target.cpu_seconds()
        cpu = cpu1 - cpu0 if cpu1 is not None and cpu0 is not None else None
    refs = references(requests, done.blocks_held)
    figs = figures(opts, requests, done, refs, cpu)
    if cleaned:
        figs.notes.append(cleaned)
    return figs, cleaned


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    opts = build_options(args, parser.error)
    try:
        with sigterm_as_exit():
            return execute(opts)
    except ValueError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted; a daemon (or fleet) started here was removed, the run's keys in --endpoint's "
            "tenant deleted, on every member of a fleet (unless --keep)",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
