"""kvstore-bench: size KV caches, model load-vs-recompute TTFT, and measure kvstore.

Subcommands that do arithmetic on the inputs (no store, no GPU):

* ``size``: KV bytes per token, per block, per tensor-parallel rank, per
  session, and fleet capacity (users x KV per user x retention);
* ``ttft``: time to load a prefix's KV cache from the store vs. to recompute
  it, the speedup, and the break-even context length (``ttft.py``).
  With ``--engine vllm`` it measures instead: a real engine's TTFT against
  the storage bandwidth, recomputing, loading everything, with the load
  planner and with layerwise loading (``ttft_sweep.py``; needs an
  environment with vLLM, deploy/setup-engines.sh).

And those that measure, each in its own module with its own options:

* ``run``: throughput and latency of a kvstore daemon (started here, or
  ``--endpoint``) through the client library, on blocks sized from the model
  geometry, with Redis and nginx as peers on the same data when installed
  (``run.py``);
* ``codec``: encode/decode GB/s per core and the ratio of each compression a
  tenant can choose, sealed or not, on real KV caches (``codec_bench.py``);
* ``nixl``: NIXL reads against HTTP GET and a plain socket copy
  (``nixl_bench.py``; needs NIXL);
* ``events``: what residency events cost PUTs and GETs, and the rate one
  subscriber takes (``events_bench.py``);
* ``s3``: PUT and ranged GET of 2 MiB objects through the daemon's S3
  gateway, against SeaweedFS and the daemon's ``/v1`` with the same client
  (``s3_bench.py``);
* ``writes``: every write path (HTTP PUT direct and sealed, batch PUT, unix
  socket, S3 gateway) against a plain write+fdatasync loop, buffered and
  O_DIRECT, on the same disk (``write_bench.py``);
* ``qos``: what tenants' QoS holds under load: a read and a write limit, a
  tenant's GET p99 alone and beside another's flood, two weights' shares of
  the daemon (``qos_bench.py``);
* ``fleet``: a fleet of daemons on one bucket (moto's S3 server): the time
  from a node's SIGKILL to its blocks served again by the survivors, and
  their read rate there against the same blocks on their own node
  (``fleet_bench.py``);
* ``fleet-day``: a fleet node's day of a trickle (8,640 small sealed
  segments in the bucket): the objects and a survivor's takeover time,
  before and after compaction merges them (``fleet_day.py``);
* ``scale``: what grows with blocks (ready after a clean stop, the index's
  size, 128-key lookups, a TTL sweep, a quota's removals, an index rebuild)
  and with tenants (creation, ready after a clean stop) (``scale_bench.py``);
* ``replay``: a request trace in Mooncake's format (its synthetic trace is
  shipped) replayed through the client: lookups, loads of the prefixes found
  and stores of the rest; the token hit ratio, split by tier, against an
  unbounded, an LRU and a Belady cache over the same requests, and the
  lookup and load latencies (``replay.py``);
* ``soak``: a mixed load for minutes or hours (tenants with quotas and TTLs,
  flushes, compactions, SIGHUP), sampling each worker's RSS, descriptors and
  threads, disk use, p99 per operation and errors; ``--check`` fails on
  growth past the warm-up, an error or a wrong byte (``soak.py``).

Examples::

    kvstore-bench size --model llama-3.1-405b --context 127188
    kvstore-bench size --model llama-3.1-70b --tp 8 --users 100000 --per-user-gb 30 --retention 15
    kvstore-bench size --model layers=40,kv_heads=8,head_dim=128,dtype=fp8 --json
    kvstore-bench ttft --model llama-3.1-70b --throughput-gbps 10 --prefill-tps 20000 --latency-ms 5
    kvstore-bench run --model llama-3.1-8b --tp 8 --duration 10 --json r.json --png r.png
    kvstore-bench replay --requests 500 --block-bytes 16KiB --json replay.json

Bad input exits 2 with a message naming the option. Output cut short by its
reader (``kvstore-bench size ... | head -2``) ends the command quietly, with
status 141 (128 + SIGPIPE) as a process killed by SIGPIPE would have.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from .argtypes import dtype_arg, model_arg, nonneg_float, nonneg_int, positive_float, positive_int
from .models import DTYPE_BYTES, ModelGeometry, resolve_model
from .sizing import (
    GB,
    PB,
    GiB,
    PiB,
    capacity_bytes,
    fmt_bytes,
    kv_bytes_per_block,
    kv_bytes_per_session,
    kv_bytes_per_token,
    tp_shard,
)
from .ttft import break_even, ttft_row

PROG = "kvstore-bench"
DEFAULT_TOKENS_PER_BLOCK = 256  # LMCache's default chunk size (vLLM's paged-attention block is 16)
DEFAULT_TTFT_TOKENS = (1024, 8192, 32768, 131072)
DEFAULT_RUN_MODEL = "Llama-3.1-8B"
# run's --blocks when not given: a daemon started here; an existing one (--endpoint: another machine's
# disk and network, often shared, so a smaller load); a --short smoke run.
RUN_BLOCKS, RUN_BLOCKS_ENDPOINT, RUN_BLOCKS_SHORT = 256, 32, 8

# The subcommands with a parser of their own: name -> (module, help). main() hands them the rest
# of argv; each module's build_parser() is that parser (``--help`` included).
DELEGATED: dict[str, tuple[str, str]] = {
    "codec": ("codec_bench", "encode/decode GB/s per core and ratio of each compression, on real KV caches"),
    "nixl": ("nixl_bench", "NIXL reads against HTTP GET and a plain socket copy (needs NIXL)"),
    "events": ("events_bench", "what residency events cost PUTs and GETs, and the rate one subscriber takes"),
    "s3": ("s3_bench", "PUT and ranged GET through the S3 gateway against SeaweedFS and /v1, one client"),
    "writes": ("write_bench", "every write path's GB/s and daemon CPU against a write+fdatasync loop"),
    "qos": ("qos_bench", "tenant QoS under load: read/write limits, GET p99 beside a flood, weights"),
    "fleet": ("fleet_bench", "a fleet on one bucket: time to take over a killed node, its blocks' read rate"),
    "fleet-day": (
        "fleet_day",
        "a fleet node's day of a trickle: bucket objects and takeover time, before and after merging",
    ),
    "scale": ("scale_bench", "what grows with blocks (start, lookups, TTL, quota, rebuild) and with tenants"),
    "replay": ("replay", "replay a request trace: token hit ratio by tier against unbounded, LRU and Belady caches"),
    "soak": ("soak", "a mixed load for minutes or hours: RSS, descriptors, threads, disk, p99 and errors bounded"),
}
COMMANDS = ("size", "ttft", "run", *DELEGATED)
ENGINES = ("vllm",)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=model_arg,
        required=True,
        help="a preset name (case-insensitive: Llama-3.1-8B, Llama-3.1-70B, Llama-3.1-405B, Qwen2.5-7B, "
        "Qwen2.5-72B, Mixtral-8x7B) or 'layers=N,kv_heads=N,head_dim=N[,dtype=fp16|bf16|fp8|fp32]'",
    )
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        help=f"KV-cache dtype, overriding the model's ({', '.join(DTYPE_BYTES)})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and the parsers of size, ttft and run (the delegated
    subcommands' are their modules' build_parser(): see subcommand_parsers())."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=f"'{PROG} COMMAND --help' lists a command's options, each with what it means and its default.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    size = sub.add_parser("size", help="KV bytes per token, block, TP rank, session; fleet capacity")
    _add_model_args(size)
    size.add_argument(
        "--tokens-per-block",
        type=positive_int,
        default=DEFAULT_TOKENS_PER_BLOCK,
        help=f"tokens in one stored block (default {DEFAULT_TOKENS_PER_BLOCK})",
    )
    size.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    size.add_argument("--context", type=nonneg_int, help="context tokens of one session")
    size.add_argument("--users", type=nonneg_int, help="users for the capacity estimate")
    size.add_argument(
        "--per-user-gb",
        type=positive_float,
        help="KV per user in GB (1e9 bytes); default: one --context session",
    )
    size.add_argument("--retention", type=positive_float, help="retention multiplier for capacity (default 1)")

    ttft = sub.add_parser("ttft", help="time to load a prefix's KV cache vs. to recompute it")
    _add_model_args(ttft)
    ttft.add_argument(
        "--throughput-gbps",
        type=positive_float,
        required=True,
        help="store throughput in GB/s (1e9 bytes per second, not gigabits)",
    )
    ttft.add_argument(
        "--prefill-tps",
        type=positive_float,
        help="prefill rate in tokens/s (required unless the preset has one; none does yet)",
    )
    ttft.add_argument(
        "--tokens",
        type=positive_int,
        nargs="+",
        default=list(DEFAULT_TTFT_TOKENS),
        help=f"prefix lengths in tokens (default {' '.join(map(str, DEFAULT_TTFT_TOKENS))})",
    )
    ttft.add_argument("--latency-ms", type=nonneg_float, default=0.0, help="fixed latency per load (default 0)")
    ttft.add_argument(
        "--engine",
        choices=ENGINES,
        help="measure instead of modelling: a real engine's TTFT (vllm) against the storage bandwidth, "
        "recomputing, loading everything, with the load planner and layerwise; an environment with vLLM "
        f"(deploy/setup-engines.sh) runs it, with its own options: '{PROG} ttft --engine vllm --help'",
    )

    run = sub.add_parser("run", help="measure a kvstore daemon's throughput and latency (and Redis, nginx)")
    default_model = resolve_model(DEFAULT_RUN_MODEL)
    block = kv_bytes_per_block(default_model, DEFAULT_TOKENS_PER_BLOCK)  # tp 1: one rank holds every head
    run.add_argument(
        "--model",
        type=model_arg,
        default=default_model,
        help=f"a preset name or 'layers=N,kv_heads=N,head_dim=N[,dtype=...]' (default {DEFAULT_RUN_MODEL})",
    )
    run.add_argument(
        "--dtype", type=dtype_arg, help=f"KV-cache dtype, overriding the model's ({', '.join(DTYPE_BYTES)})"
    )
    run.add_argument(
        "--tokens-per-block",
        type=positive_int,
        help=f"tokens per engine block (default {DEFAULT_TOKENS_PER_BLOCK}; --short 16)",
    )
    run.add_argument(
        "--tp", type=positive_int, default=1, help="TP ranks: one kvstore block per engine block per rank (default 1)"
    )
    run.add_argument(
        "--blocks",
        type=positive_int,
        help="distinct blocks loaded before the run; the data set is --blocks blocks of --tokens-per-block "
        f"tokens of one TP rank's KV ({_binary(block)} each for {DEFAULT_RUN_MODEL} at {DEFAULT_TOKENS_PER_BLOCK} "
        f"tokens, tp 1). Default {RUN_BLOCKS} ({_binary(RUN_BLOCKS * block)} of the default model); "
        f"{RUN_BLOCKS_ENDPOINT} with --endpoint ({_binary(RUN_BLOCKS_ENDPOINT * block)}); {RUN_BLOCKS_SHORT} "
        "with --short",
    )
    run.add_argument("--concurrency", type=positive_int, help="operations in flight (default 8; --short 4)")
    run.add_argument("--duration", type=positive_float, help="seconds per system measured (default 20; --short 2)")
    run.add_argument("--ops", type=positive_int, help="operations per system measured, instead of --duration")
    run.add_argument("--read-ratio", type=nonneg_float, default=0.9, help="fraction of reads (default 0.9)")
    run.add_argument(
        "--hit-ratio", type=nonneg_float, default=1.0, help="fraction of reads of stored keys (default 1.0)"
    )
    run.add_argument(
        "--endpoint",
        metavar="URL",
        help="measure an existing daemon at this URL instead of starting one here. The run stores its blocks "
        f"(default {RUN_BLOCKS_ENDPOINT}: {_binary(RUN_BLOCKS_ENDPOINT * block)} of the default model) and its "
        "writes in --token's tenant under keys bench-<run id>-*, and deletes them all at the end unless --keep",
    )
    run.add_argument("--token", help="the tenant token for --endpoint (default $KVSTORE_TOKEN)")
    run.add_argument(
        "--keep",
        action="store_true",
        help="with --endpoint: leave the run's blocks in the tenant (keys bench-<run id>-*) instead of deleting them",
    )
    run.add_argument("--policy", choices=("sealed", "direct"), help="the local daemon's tenant policy (default sealed)")
    run.add_argument("--peers", help="redis,nginx or none (default: both when installed; none with --short)")
    run.add_argument(
        "--context", type=positive_int, default=32768, help="tokens for the TTFT model line (default 32768)"
    )
    run.add_argument("--prefill-tps", type=positive_float, help="prefill rate in tokens/s for the TTFT line")
    run.add_argument("--timeout", type=positive_float, default=30.0, help="per-operation deadline, s (default 30)")
    run.add_argument("--seed", type=nonneg_int, default=1, help="seed of the operation mix (default 1)")
    run.add_argument("--short", action="store_true", help="a ~2 s smoke run: few small blocks, no peers")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is no TTY)")
    run.add_argument("--json", type=Path, metavar="PATH", help="write every figure and the time series as JSON")
    run.add_argument(
        "--png",
        type=Path,
        metavar="PATH",
        help="write a chart: throughput and p50/p99 over time (needs matplotlib; checked before measuring)",
    )
    # add_help=False: `kvstore-bench codec --help` never reaches this parser (main() hands it to codec_bench).
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser, {"size": size, "ttft": ttft, "run": run}


def _binary(n: int) -> str:
    """``n`` bytes in binary units (``8.00 GiB``), for help texts."""
    return fmt_bytes(n).split(" = ")[-1]


def _model_of(args: argparse.Namespace) -> ModelGeometry:
    model: ModelGeometry = args.model
    return model.with_dtype(args.dtype) if args.dtype else model


def _model_json(model: ModelGeometry) -> dict[str, object]:
    return {
        "name": model.name,
        "layers": model.layers,
        "kv_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "dtype_bytes": model.dtype_bytes,
    }


def _model_line(model: ModelGeometry) -> str:
    return (
        f"{model.name}: {model.layers} layers x 2 (K,V) x {model.kv_heads} KV heads x {model.head_dim} head dim "
        f"x {model.dtype_bytes} B ({model.dtype_name})"
    )


def _table(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_size(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    model = _model_of(args)
    if args.users is None:
        for opt, value in (("--per-user-gb", args.per_user_gb), ("--retention", args.retention)):
            if value is not None:
                parser.error(f"argument {opt}: only used with --users")
    elif args.per_user_gb is None and args.context is None:
        parser.error("argument --users: needs --per-user-gb, or --context to size one user as one session")
    try:
        shard = tp_shard(model, args.tp)
    except ValueError as e:
        parser.error(f"argument --tp: {e}")

    bpt = kv_bytes_per_token(model)
    block = kv_bytes_per_block(model, args.tokens_per_block)
    out: dict[str, object] = {
        "model": _model_json(model),
        "bytes_per_token": bpt,
        "tokens_per_block": args.tokens_per_block,
        "bytes_per_block": block,
        "tp": {
            "size": shard.tp,
            "kv_heads_per_rank": shard.kv_heads_per_rank,
            "replication": shard.replication,
            "bytes_per_token_per_rank": shard.bytes_per_token_per_rank,
            "bytes_per_block_per_rank": shard.bytes_per_token_per_rank * args.tokens_per_block,
            "bytes_per_token_all_ranks": shard.bytes_per_token_all_ranks,
        },
        "session": None,
        "capacity": None,
    }
    rows = [
        ("model", _model_line(model)),
        ("KV per token", fmt_bytes(bpt)),
        (f"KV per block ({args.tokens_per_block:,} tokens)", fmt_bytes(block)),
    ]
    repl = f", each head on {shard.replication} ranks" if shard.replication > 1 else ""
    rows.append(
        (
            f"per TP rank (tp={shard.tp})",
            f"{shard.kv_heads_per_rank} KV head(s){repl}: {fmt_bytes(shard.bytes_per_token_per_rank)} per token, "
            f"{fmt_bytes(shard.bytes_per_token_per_rank * args.tokens_per_block)} per block",
        )
    )
    if shard.replication > 1:
        rows.append(("all ranks (with replicas)", f"{fmt_bytes(shard.bytes_per_token_all_ranks)} per token"))

    session_bytes: int | None = None
    if args.context is not None:
        session_bytes = kv_bytes_per_session(model, args.context)
        out["session"] = {
            "context_tokens": args.context,
            "bytes": session_bytes,
            "gb": session_bytes / GB,
            "gib": session_bytes / GiB,
            "blocks": -(-args.context // args.tokens_per_block),
        }
        rows.append((f"per session ({args.context:,} tokens)", fmt_bytes(session_bytes)))

    if args.users is not None:
        if args.per_user_gb is not None:
            per_user: float = args.per_user_gb * GB
            per_user_label = f"{args.per_user_gb:g} GB"
        else:
            assert session_bytes is not None
            per_user = session_bytes
            per_user_label = f"{session_bytes / GB:.2f} GB (one session)"
        retention = 1.0 if args.retention is None else args.retention
        total = capacity_bytes(args.users, per_user, retention)
        out["capacity"] = {
            "users": args.users,
            "per_user_bytes": per_user,
            "retention": retention,
            "bytes": total,
            "pb": total / PB,
            "pib": total / PiB,
        }
        rows.append(
            (
                "capacity",
                f"{args.users:,} users x {per_user_label} x {retention:g} retention = {fmt_bytes(total)}",
            )
        )

    print(json.dumps(out, indent=2) if args.json else _table(rows))
    return 0


def run_ttft(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    model = _model_of(args)
    prefill: float | None = args.prefill_tps
    if prefill is None:
        prefill = model.prefill_tokens_per_s_8gpu
        if prefill is None:
            parser.error(f"argument --prefill-tps: required: {model.name} has no preset prefill rate")
    bpt = kv_bytes_per_token(model)
    latency_s = args.latency_ms / 1e3
    rows = [ttft_row(n, bpt, args.throughput_gbps, prefill, latency_s) for n in args.tokens]
    be = break_even(bpt, args.throughput_gbps, prefill, latency_s)

    if args.json:
        out: dict[str, object] = {
            "model": _model_json(model),
            "bytes_per_token": bpt,
            "throughput_gbps": args.throughput_gbps,
            "prefill_tps": prefill,
            "latency_ms": args.latency_ms,
            "rows": [
                {
                    "tokens": r.tokens,
                    "kv_bytes": r.kv_bytes,
                    "load_s": r.load_s,
                    "recompute_s": r.recompute_s,
                    "speedup": r.speedup if math.isfinite(r.speedup) else None,
                    "winner": r.winner,
                }
                for r in rows
            ],
            "break_even": {
                "verdict": be.verdict,
                "tokens": be.tokens,
                "saved_s_per_token": be.saved_s_per_token,
                "text": be.describe(),
            },
        }
        print(json.dumps(out, indent=2))
        return 0

    print(_model_line(model))
    print(f"KV per token {fmt_bytes(bpt)}")
    print(
        f"store {args.throughput_gbps:g} GB/s, latency {args.latency_ms:g} ms; "
        f"prefill {prefill:,.0f} tokens/s (linear model)"
    )
    header = ("tokens", "KV bytes", "load", "recompute", "speedup", "faster")
    table = [
        (
            f"{r.tokens:,}",
            fmt_bytes(r.kv_bytes).split(" = ", 1)[-1],
            f"{r.load_s * 1e3:,.1f} ms",
            f"{r.recompute_s * 1e3:,.1f} ms",
            f"{r.speedup:.2f}x" if math.isfinite(r.speedup) else "inf",
            r.winner,
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths, strict=True)))
    print(f"break-even: {be.describe()}")
    return 0


def _module(name: str) -> ModuleType:
    """A benchmark module of this package, imported when its subcommand runs (some
    import the client library, boto3 or NIXL: ``size`` needs none of them)."""
    return importlib.import_module(f".{name}", __package__)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand's parser, by the command line that reaches it: "size", "ttft",
    "run", each of DELEGATED, and "ttft --engine vllm" (ttft_sweep's)."""
    _, parsers = build_parser()
    out = dict(parsers)
    for name, (module, _) in DELEGATED.items():
        build: Callable[[], argparse.ArgumentParser] = _module(module).build_parser
        out[name] = build()
    out["ttft --engine vllm"] = _module("ttft_sweep").build_parser()
    return out


def _engine_at(args: list[str]) -> int | None:
    return next((i for i, a in enumerate(args) if a == "--engine" or a.startswith("--engine=")), None)


def _dispatch(args_in: list[str]) -> int:
    if args_in[:1] and args_in[0] in DELEGATED:
        entry: Callable[[list[str]], int] = _module(DELEGATED[args_in[0]][0]).main
        return entry(args_in[1:])
    rest = args_in[1:]
    at = _engine_at(rest) if args_in[:1] == ["ttft"] else None
    if at is not None:  # the measured sweep: ttft_sweep's own options (the modelling ones do not apply)
        engine = rest[at].partition("=")[2] if "=" in rest[at] else (rest[at + 1] if at + 1 < len(rest) else "")
        if engine not in ENGINES:
            sys.stderr.write(f"{PROG} ttft: argument --engine: only {', '.join(ENGINES)} is measured, got {engine!r}\n")
            return 2
        del rest[at : at + (1 if "=" in rest[at] else 2)]
        sweep: Callable[[list[str]], int] = _module("ttft_sweep").main
        return sweep(rest)
    parser, subparsers = build_parser()
    args = parser.parse_args(args_in)
    if args.command == "size":
        return run_size(args, subparsers["size"])
    if args.command == "run":
        from .run import run_bench  # imports the client library and aiohttp only when measuring

        return run_bench(args, subparsers["run"])
    return run_ttft(args, subparsers["ttft"])


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    try:
        try:
            return _dispatch(args_in)
        finally:  # here, where a reader that went away can still be told from a failure
            sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe (`kvstore-bench size ... | head -2`): what it did not
        # read is of no use to anyone. Python ignores SIGPIPE, so this is an exception, and
        # the interpreter would flush stdout again at exit and print another: point stdout
        # at /dev/null first (the recipe of the signal module's documentation).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
