"""kvstore-bench: KV-cache sizing and a load-vs-recompute TTFT model, from model geometry alone.

Subcommands (no store, no GPU; arithmetic on the inputs):

* ``size``: KV bytes per token, per block, per tensor-parallel rank, per
  session, and fleet capacity (users x KV per user x retention);
* ``ttft``: time to load a prefix's KV cache from the store vs. to recompute
  it, the speedup, and the break-even context length (see ``bench.ttft``).
  With ``--engine vllm`` it measures instead: a real engine's TTFT against
  the storage bandwidth, recomputing, loading everything, with the load
  planner and with layerwise loading (``bench.ttft_sweep``; needs
  deploy/setup-engines.sh).

And one that measures (see ``bench.run``):

* ``run``: throughput and latency of a kvstore daemon (started here, or
  ``--endpoint``) through the client library, on blocks sized from the model
  geometry, with Redis and nginx as peers on the same data when installed;
* ``codec``: encode/decode GB/s per core and the ratio of each compression a
  tenant can choose, sealed or not, on real KV caches (``bench.codec_bench``);
* ``s3``: PUT and ranged GET of 2 MiB objects through the daemon's S3
  gateway, against SeaweedFS and the daemon's ``/v1`` with the same client
  (``bench.s3_bench``);
* ``writes``: every write path (HTTP PUT direct and sealed, batch PUT, unix
  socket, S3 gateway) against a plain write+fdatasync loop, buffered and
  O_DIRECT, on the same disk (``bench.write_bench``).
* ``qos``: what tenants' QoS holds under load: a read and a write limit, a
  tenant's GET p99 alone and beside another's flood, two weights' shares of
  the daemon (``bench.qos_bench``).
* ``fleet``: a fleet of daemons on one bucket (moto's S3 server): the time
  from a node's SIGKILL to its blocks served again by the survivors, and
  their read rate there against the same blocks on their own node
  (``bench.fleet_bench``).

Examples::

    .venv/bin/python -m bench.cli size --model llama-3.1-405b --context 127188
    .venv/bin/python -m bench.cli size --model llama-3.1-70b --tp 8 --users 100000 --per-user-gb 30 --retention 15
    .venv/bin/python -m bench.cli size --model layers=40,kv_heads=8,head_dim=128,dtype=fp8 --json
    .venv/bin/python -m bench.cli ttft --model llama-3.1-70b --throughput-gbps 10 --prefill-tps 20000 --latency-ms 5
    .venv/bin/python -m bench.cli run --model llama-3.1-8b --tp 8 --duration 10 --json r.json --png r.png

Bad input exits 2 with a message naming the option.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.models import DTYPE_BYTES, ModelGeometry, dtype_bytes, resolve_model
from bench.sizing import (
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
from bench.ttft import break_even, ttft_row

PROG = "kvstore-bench"
DEFAULT_TOKENS_PER_BLOCK = 256  # LMCache's default chunk size (vLLM's paged-attention block is 16)
DEFAULT_TTFT_TOKENS = (1024, 8192, 32768, 131072)


# -- argument types: each raises ArgumentTypeError, which argparse reports as "argument --opt: <message>", exit 2


def _model(text: str) -> ModelGeometry:
    try:
        return resolve_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str) -> str:
    try:
        dtype_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip().lower()


def _int(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
    return value


def _positive_int(text: str) -> int:
    return _int(text, 1)


def _nonneg_int(text: str) -> int:
    return _int(text, 0)


def _float(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite")
    if value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"{value:g} must be {'at least 0' if allow_zero else 'positive'}")
    return value


def _positive_float(text: str) -> float:
    return _float(text, allow_zero=False)


def _nonneg_float(text: str) -> float:
    return _float(text, allow_zero=True)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=_model,
        required=True,
        help="a preset name (case-insensitive: Llama-3.1-8B, Llama-3.1-70B, Llama-3.1-405B, Qwen2.5-7B, "
        "Qwen2.5-72B, Mixtral-8x7B) or 'layers=N,kv_heads=N,head_dim=N[,dtype=fp16|bf16|fp8|fp32]'",
    )
    p.add_argument(
        "--dtype",
        type=_dtype,
        help=f"KV-cache dtype, overriding the model's ({', '.join(DTYPE_BYTES)})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{size,ttft,run,codec,nixl,events,s3,writes,qos,fleet}"
    )
    # codec, nixl, events, s3, writes, qos and fleet have their own parsers (bench/codec_bench.py, nixl_bench.py,
    # events_bench.py, s3_bench.py, write_bench.py, qos_bench.py, fleet_bench.py):
    # main() hands them the rest of argv.
    sub.add_parser("codec", help="encode/decode GB/s per core and ratio of each compression, on real KV caches")
    sub.add_parser("nixl", help="NIXL reads against HTTP GET and a plain socket copy (needs NIXL)")
    sub.add_parser("events", help="what residency events cost PUTs and GETs, and the rate one subscriber takes")
    sub.add_parser("s3", help="PUT and ranged GET through the S3 gateway against SeaweedFS and /v1, one client")
    sub.add_parser("writes", help="every write path's GB/s and daemon CPU against a write+fdatasync loop")
    sub.add_parser("qos", help="tenant QoS under load: read/write limits, GET p99 beside a flood, weights")
    sub.add_parser("fleet", help="a fleet on one bucket: time to take over a killed node, its blocks' read rate")

    size = sub.add_parser("size", help="KV bytes per token, block, TP rank, session; fleet capacity")
    _add_model_args(size)
    size.add_argument(
        "--tokens-per-block",
        type=_positive_int,
        default=DEFAULT_TOKENS_PER_BLOCK,
        help=f"tokens in one stored block (default {DEFAULT_TOKENS_PER_BLOCK})",
    )
    size.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    size.add_argument("--context", type=_nonneg_int, help="context tokens of one session")
    size.add_argument("--users", type=_nonneg_int, help="users for the capacity estimate")
    size.add_argument(
        "--per-user-gb",
        type=_positive_float,
        help="KV per user in GB (1e9 bytes); default: one --context session",
    )
    size.add_argument("--retention", type=_positive_float, help="retention multiplier for capacity (default 1)")

    ttft = sub.add_parser("ttft", help="time to load a prefix's KV cache vs. to recompute it")
    _add_model_args(ttft)
    ttft.add_argument(
        "--throughput-gbps",
        type=_positive_float,
        required=True,
        help="store throughput in GB/s (1e9 bytes per second, not gigabits)",
    )
    ttft.add_argument(
        "--prefill-tps",
        type=_positive_float,
        help="prefill rate in tokens/s (required unless the preset has one; none does yet)",
    )
    ttft.add_argument(
        "--tokens",
        type=_positive_int,
        nargs="+",
        default=list(DEFAULT_TTFT_TOKENS),
        help=f"prefix lengths in tokens (default {' '.join(map(str, DEFAULT_TTFT_TOKENS))})",
    )
    ttft.add_argument("--latency-ms", type=_nonneg_float, default=0.0, help="fixed latency per load (default 0)")

    run = sub.add_parser("run", help="measure a kvstore daemon's throughput and latency (and Redis, nginx)")
    run.add_argument(
        "--model",
        type=_model,
        default=resolve_model("Llama-3.1-8B"),
        help="a preset name or 'layers=N,kv_heads=N,head_dim=N[,dtype=...]' (default Llama-3.1-8B)",
    )
    run.add_argument("--dtype", type=_dtype, help=f"KV-cache dtype, overriding the model's ({', '.join(DTYPE_BYTES)})")
    run.add_argument(
        "--tokens-per-block",
        type=_positive_int,
        help=f"tokens per engine block (default {DEFAULT_TOKENS_PER_BLOCK}; --short 16)",
    )
    run.add_argument(
        "--tp", type=_positive_int, default=1, help="TP ranks: one kvstore block per engine block per rank (default 1)"
    )
    run.add_argument("--blocks", type=_positive_int, help="blocks loaded before the run (default 256; --short 8)")
    run.add_argument("--concurrency", type=_positive_int, help="operations in flight (default 8; --short 4)")
    run.add_argument("--duration", type=_positive_float, help="seconds per system measured (default 20; --short 2)")
    run.add_argument("--ops", type=_positive_int, help="operations per system measured, instead of --duration")
    run.add_argument("--read-ratio", type=_nonneg_float, default=0.9, help="fraction of reads (default 0.9)")
    run.add_argument(
        "--hit-ratio", type=_nonneg_float, default=1.0, help="fraction of reads of stored keys (default 1.0)"
    )
    run.add_argument("--endpoint", help="an existing daemon's URL (default: start a local one)")
    run.add_argument("--token", help="the tenant token for --endpoint (default $KVSTORE_TOKEN)")
    run.add_argument("--policy", choices=("sealed", "direct"), help="the local daemon's tenant policy (default sealed)")
    run.add_argument("--peers", help="redis,nginx or none (default: both when installed; none with --short)")
    run.add_argument(
        "--context", type=_positive_int, default=32768, help="tokens for the TTFT model line (default 32768)"
    )
    run.add_argument("--prefill-tps", type=_positive_float, help="prefill rate in tokens/s for the TTFT line")
    run.add_argument("--timeout", type=_positive_float, default=30.0, help="per-operation deadline, s (default 30)")
    run.add_argument("--seed", type=_nonneg_int, default=1, help="seed of the operation mix (default 1)")
    run.add_argument("--short", action="store_true", help="a ~2 s smoke run: few small blocks, no peers")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (also off when stderr is no TTY)")
    run.add_argument("--json", type=Path, metavar="PATH", help="write every figure and the time series as JSON")
    run.add_argument("--png", type=Path, metavar="PATH", help="write a chart: throughput and p50/p99 over time")
    return parser, {"size": size, "ttft": ttft, "run": run}


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


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in[:1] == ["codec"]:
        from bench import codec_bench

        return codec_bench.main(args_in[1:])
    if args_in[:1] == ["nixl"]:
        from bench import nixl_bench

        return nixl_bench.main(args_in[1:])
    if args_in[:1] == ["events"]:
        from bench import events_bench

        return events_bench.main(args_in[1:])
    if args_in[:1] == ["s3"]:
        from bench import s3_bench

        return s3_bench.main(args_in[1:])
    if args_in[:1] == ["writes"]:
        from bench import write_bench

        return write_bench.main(args_in[1:])
    if args_in[:1] == ["ttft"] and any(a == "--engine" or a.startswith("--engine=") for a in args_in):
        from bench import ttft_sweep

        rest = args_in[1:]
        at = next(i for i, a in enumerate(rest) if a == "--engine" or a.startswith("--engine="))
        engine = rest[at].partition("=")[2] if "=" in rest[at] else (rest[at + 1] if at + 1 < len(rest) else "")
        if engine != "vllm":
            sys.stderr.write(f"{PROG} ttft: argument --engine: only 'vllm' is measured here, got {engine!r}\n")
            return 2
        del rest[at : at + (1 if "=" in rest[at] else 2)]
        return ttft_sweep.main(rest)
    if args_in[:1] == ["fleet"]:
        from bench import fleet_bench

        return fleet_bench.main(args_in[1:])
    if args_in[:1] == ["qos"]:
        from bench import qos_bench

        return qos_bench.main(args_in[1:])
    parser, subparsers = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "size":
        return run_size(args, subparsers["size"])
    if args.command == "run":
        from bench.run import run_bench  # imports the client library and aiohttp only when measuring

        return run_bench(args, subparsers["run"])
    return run_ttft(args, subparsers["ttft"])


if __name__ == "__main__":
    sys.exit(main())
