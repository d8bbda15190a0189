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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .argtypes import dtype_arg, model_arg, positive_float, positive_int
from .harness import sigterm_as_exit, tree_cpu_seconds
from .models import ModelGeometry, resolve_model
from .plots import matplotlib_missing
from .replay_report import figures, render, write_json, write_png
from .replayer import ReplayOptions, replay
from .run import Leftovers, clean_endpoint
from .sizing import fmt_bytes, kv_bytes_per_block
from .trace import MOONCAKE_TOKENS_PER_BLOCK, SYNTHETIC, load_trace, references, shape

PROG = "kvstore-bench replay"
DEFAULT_MODEL = "Llama-3.1-8B"
DAEMON_MAX_BLOCK = 64 << 20  # the daemon's default max_block_size
MIN_BLOCK_BYTES = 64


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--trace",
        type=Path,
        default=SYNTHETIC,
        metavar="FILE",
        help="a trace in Mooncake's JSONL format (default: Mooncake's synthetic trace, shipped with the package)",
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
        metavar="URL",
        help="replay against an existing daemon at this URL instead of starting one; the run's keys "
        "(bench-<run id>-*) are deleted at the end unless --keep",
    )
    ap.add_argument("--token", help="the tenant token for --endpoint (default $KVSTORE_TOKEN)")
    ap.add_argument(
        "--metrics-token",
        help="with --endpoint: the bearer token for its /metrics, where it asks for one "
        "(default $KVSTORE_METRICS_TOKEN)",
    )
    ap.add_argument("--keep", action="store_true", help="with --endpoint: leave the run's blocks in the tenant")
    ap.add_argument(
        "--policy", choices=("sealed", "direct"), help="the started daemon's tenant policy (default sealed)"
    )
    ap.add_argument(
        "--quota",
        type=_size,
        help="the started daemon's tenant quota in bytes (e.g. 64MiB): its least recently used blocks go",
    )
    ap.add_argument(
        "--admit-after",
        type=_admit_after,
        default=1,
        metavar="N",
        help="the started daemon's tenant stores a block only at its N-th offer within an hour "
        "(its admit_after, 1 to 16; default 1: every block at its first)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the started daemon, passed as its KVSTORE_ variable (repeatable; e.g. tier_dir=/mnt/g4)",
    )
    ap.add_argument(
        "--prefill-tps",
        type=positive_float,
        help="the prefill rate in tokens/s, for the prefill time the hits save (none by default: no preset has one)",
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


def _check_endpoint(args: argparse.Namespace, error: Callable[[str], Any]) -> None:
    if args.endpoint is None:
        for opt, given in (("--token", args.token), ("--metrics-token", args.metrics_token), ("--keep", args.keep)):
            if given:
                error(f"argument {opt}: only with --endpoint")
        return
    if not args.endpoint.startswith(("http://", "https://")):
        error(f"argument --endpoint: {args.endpoint!r} is not an http:// or https:// URL")
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


def build_options(args: argparse.Namespace, error: Callable[[str], Any]) -> ReplayOptions:
    """Check and complete the parsed options; ``error`` (parser.error) exits 2."""
    _check_endpoint(args, error)
    model: ModelGeometry = args.model.with_dtype(args.dtype) if args.dtype else args.model
    if args.png is not None and (why := matplotlib_missing()) is not None:
        error(f"argument --png: {why}")  # now, not after the replay
    if not args.trace.is_file():
        error(f"argument --trace: {args.trace} is not a file")
    return ReplayOptions(
        trace=args.trace,
        requests=args.requests,
        model=model,
        tokens_per_block=args.tokens_per_block,
        block_bytes=args.block_bytes or kv_bytes_per_block(model, args.tokens_per_block),
        speed=args.speed,
        concurrency=args.concurrency,
        endpoint=args.endpoint,
        token=args.token or os.environ.get("KVSTORE_TOKEN"),
        metrics_token=args.metrics_token or os.environ.get("KVSTORE_METRICS_TOKEN"),
        keep=args.keep,
        policy=args.policy or "sealed",
        quota=args.quota,
        admit_after=args.admit_after,
        settings=_settings(args.set, error),
        prefill_tps=args.prefill_tps or model.prefill_tokens_per_s_8gpu,
        timeout=args.timeout,
        progress=not args.no_progress and sys.stderr.isatty(),
        json_path=args.json,
        png_path=args.png,
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


def _check_space(opts: ReplayOptions, unique_blocks: int, where: Path) -> None:
    """A started daemon holds every block of the replay (or its quota's worth):
    refused up front when that cannot fit, rather than a full disk mid-run."""
    need = unique_blocks * opts.block_bytes
    if opts.quota is not None:
        need = min(need, opts.quota)
    need = int(need * 1.1) + (256 << 20)
    free = shutil.disk_usage(where).free
    if free < need:
        raise ValueError(
            f"argument --block-bytes: {unique_blocks:,} blocks of {fmt_bytes(opts.block_bytes)} need about "
            f"{fmt_bytes(need)}, {where} has {fmt_bytes(free)} free: scale the blocks down (e.g. --block-bytes "
            "16KiB), replay fewer --requests or set a --quota"
        )


@contextlib.contextmanager
def _target(opts: ReplayOptions, unique_blocks: int) -> Iterator[tuple[str, str, int | None]]:
    """(endpoint, token, the daemon's pid when started here)."""
    if opts.endpoint is not None:
        yield opts.endpoint, opts.token or "", None
        return
    from .daemon import daemon

    _check_space(opts, unique_blocks, Path("/var/tmp"))
    tenant = {"admit_after": opts.admit_after} if opts.admit_after > 1 else None
    with daemon(_started_settings(opts), policy=opts.policy, tenant=tenant) as d:
        admits = f", admit_after {opts.admit_after}" if tenant else ""
        say(f"started kvstore on {d.base} (data dir {d.root}/data), tenant 'bench', policy {opts.policy}{admits}")
        yield d.base, d.token, d.proc.pid


def execute(opts: ReplayOptions) -> int:
    try:
        requests = load_trace(opts.trace, opts.requests)
    except ValueError as e:
        raise ValueError(f"argument --trace: {e}") from None
    cut = shape(requests)
    run_id = os.urandom(4).hex()
    say(
        f"{PROG}: {opts.trace.name}, {cut.requests:,} requests, {cut.tokens:,} input tokens, "
        f"{cut.unique_blocks:,} unique blocks of {fmt_bytes(opts.block_bytes).split(' = ')[-1]}"
    )
    cleaned: str | None = ""
    with _target(opts, cut.unique_blocks) as (endpoint, token, pid):
        cpu0 = tree_cpu_seconds(pid) if pid is not None else None
        try:
            done = asyncio.run(replay(opts, requests, endpoint, token, run_id))
        finally:
            if opts.endpoint is not None:
                left = Leftovers(endpoint, token, run_id, opts.keep, opts.timeout, opts.concurrency)
                cleaned = clean_endpoint(left, PROG)
        cpu = tree_cpu_seconds(pid) - cpu0 if pid is not None and cpu0 is not None else None
    refs = references(requests, done.blocks_held)
    figs = figures(opts, requests, done, refs, cpu)
    if cleaned:
        figs.notes.append(cleaned)
    say(render(figs))
    if opts.json_path is not None:
        write_json(opts.json_path, figs)
        say(f"wrote {opts.json_path}")
    if opts.png_path is not None:
        write_png(opts.png_path, figs)
        say(f"wrote {opts.png_path}")
    return 0 if cleaned is not None else 1


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
            f"{PROG}: interrupted; a daemon started here was removed, the run's keys in --endpoint's tenant deleted "
            "(unless --keep)",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
