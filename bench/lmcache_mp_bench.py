"""Store and load GB/s of LMCache's multiprocess-mode L2 adapters: kvstore's
(``kvstore_client.adapters.lmcache_mp``) against LMCache's own ``fs``
adapter, in one run, on the same disk (needs .venv-engines)::

    deploy/setup-engines.sh
    .venv-engines/bin/python -m kvstore_bench.lmcache_mp_bench --chunks 64 --chunk-mib 4 --repeats 3 --json mp.json

Each adapter is built as ``lmcache server`` builds it (its ``--l2-adapter``
JSON through LMCache's parser and factory) and driven as its controllers
drive it: store tasks of ``--batch`` chunks, all submitted at once and
awaited on the store event fd; one lookup-and-lock task over every chunk;
load tasks of ``--batch`` chunks into fresh memory objects, every byte
compared; unlock. Chunks are real KV-cache bytes (the package's ``data/kv``), each
repeat under new keys, so every store writes.

Targets (one daemon per policy, data under /var/tmp like the fs adapter's
directory): ``fs`` (LMCache's, the reference), ``kvstore-http`` (a direct
tenant over TCP), ``kvstore-sealed`` (AES-GCM and zstd), ``kvstore-unix``
(a direct tenant over the daemon's unix socket: loads read the segment files
through read plans into LMCache's objects), ``kvstore-nixl`` (the same tenant
with ``transport: nixl``: one-sided READs and WRITEs between this process's
NIXL agent and the daemon's, UCX over TCP on loopback here). Rounds are interleaved with a
rotating order, after ``--warmup`` rounds that are not counted (thread pools,
connections, first page faults); the report gives medians and each target's ratio to ``fs``
per repeat, plus CPU seconds per GB of this process (LMCache and the adapter)
and of the daemon.

Durability differs, and is stated: the ``fs`` adapter writes files into the
page cache and never fsyncs; the daemon runs with ``durability = interval``
(a background fsync at most every ``fsync_interval_ms``), its closest
setting. Loads come from the page cache for both (``--drop-caches`` drops
it before each load phase where the kernel lets this process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from .daemon import daemon
from .harness import cpu_seconds, pid_cpu_seconds
from .s3_bench import cut_objects
from .samples import SAMPLES, load_pool

MiB = 1 << 20
PLUGIN = {"type": "plugin", "module_path": "kvstore_client.adapters.lmcache_mp", "class_name": "KVStoreL2Adapter"}
TARGETS = ("fs", "kvstore-http", "kvstore-sealed", "kvstore-unix", "kvstore-nixl")
# NIXL between this process and the daemon: UCX over TCP on loopback, with ENGINES.md's segment sizes.
UCX = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
TIMEOUT_S = 300.0


def _lmcache() -> Any:
    """LMCache's pieces (imported late: only .venv-engines has them)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import torch
        from lmcache.v1.distributed.api import ObjectKey
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
        from lmcache.v1.platform import consume_fd

        return argparse.Namespace(
            torch=torch,
            ObjectKey=ObjectKey,
            create_l2_adapter=create_l2_adapter,
            parse_args_to_l2_adapters_config=parse_args_to_l2_adapters_config,
            MemoryFormat=MemoryFormat,
            MemoryObjMetadata=MemoryObjMetadata,
            TensorMemoryObj=TensorMemoryObj,
            consume_fd=consume_fd,
            parser=add_l2_adapters_args(argparse.ArgumentParser()),
        )


def make_adapter(lm: Any, spec: dict[str, Any]) -> Any:
    config = lm.parse_args_to_l2_adapters_config(lm.parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    return lm.create_l2_adapter(config.adapters[0])


def memory_obj(lm: Any, data: bytes | None, size: int) -> Any:
    """A host memory object as LMCache's L1 hands them out (bytes as uint8)."""
    tensor = lm.torch.empty(size, dtype=lm.torch.uint8)
    if data is not None:
        tensor.copy_(lm.torch.frombuffer(bytearray(data), dtype=lm.torch.uint8))
    meta = lm.MemoryObjMetadata(
        shape=lm.torch.Size([size]),
        dtype=lm.torch.uint8,
        address=0,
        phy_size=size,
        ref_count=1,
        fmt=lm.MemoryFormat.KV_2LTD,
    )
    return lm.TensorMemoryObj(tensor, meta, parent_allocator=None)


def _wait_all(lm: Any, fd: int, tasks: list[int], poll: Callable[[], dict[int, Any]]) -> dict[int, Any]:
    import select

    done: dict[int, Any] = {}
    p = select.poll()
    p.register(fd, select.POLLIN)
    deadline = time.monotonic() + TIMEOUT_S
    while len(done) < len(tasks):
        if time.monotonic() > deadline:
            raise SystemExit(f"{len(tasks) - len(done)} tasks did not finish within {TIMEOUT_S} s")
        if p.poll(50):
            with suppress(BlockingIOError):
                lm.consume_fd(fd)
        done.update(poll())
    return done


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def run_target(
    lm: Any, adapter: Any, chunks: list[bytes], batch: int, salt: int, daemon_pid: int | None, drop: bool
) -> dict[str, float]:
    """One round on one adapter: store, lookup-and-lock, load (verified), unlock."""
    keys = [
        lm.ObjectKey(chunk_hash=(salt * 1_000_003 + i).to_bytes(32, "big"), model_name="bench/model", kv_rank=0)
        for i in range(len(chunks))
    ]
    size = len(chunks[0])
    total = size * len(chunks)
    objs = [memory_obj(lm, c, size) for c in chunks]
    batches = [list(range(i, min(i + batch, len(chunks)))) for i in range(0, len(chunks), batch)]
    out: dict[str, float] = {}

    cpu0, dcpu0, t0 = cpu_seconds(), pid_cpu_seconds(daemon_pid) if daemon_pid else 0.0, time.perf_counter()
    tasks = [adapter.submit_store_task([keys[i] for i in b], [objs[i] for i in b]) for b in batches]
    results = _wait_all(lm, adapter.get_store_event_fd(), tasks, adapter.pop_completed_store_tasks)
    out["store_s"] = time.perf_counter() - t0
    out["store_cpu_s"] = cpu_seconds() - cpu0
    out["store_daemon_cpu_s"] = (pid_cpu_seconds(daemon_pid) - dcpu0) if daemon_pid else 0.0
    if not all(results[t].is_successful() for t in tasks):
        raise SystemExit("a store task failed")

    if drop:
        _drop_caches()
    t0 = time.perf_counter()
    task = adapter.submit_lookup_and_lock_task(keys, {})
    found = _wait_all(lm, adapter.get_lookup_and_lock_event_fd(), [task], lambda: _one(adapter, task))[task]
    out["lookup_s"] = time.perf_counter() - t0
    if found.popcount() != len(keys):
        raise SystemExit(f"lookup found {found.popcount()} of {len(keys)} chunks")

    dst = [memory_obj(lm, None, size) for _ in chunks]
    cpu0, dcpu0, t0 = cpu_seconds(), pid_cpu_seconds(daemon_pid) if daemon_pid else 0.0, time.perf_counter()
    tasks = [adapter.submit_load_task([keys[i] for i in b], [dst[i] for i in b]) for b in batches]
    results = _wait_all(lm, adapter.get_load_event_fd(), tasks, lambda: _loads(adapter, tasks))
    out["load_s"] = time.perf_counter() - t0
    out["load_cpu_s"] = cpu_seconds() - cpu0
    out["load_daemon_cpu_s"] = (pid_cpu_seconds(daemon_pid) - dcpu0) if daemon_pid else 0.0
    adapter.submit_unlock(keys)
    loaded = sum(results[t].popcount() for t in tasks)
    wrong = sum(bytes(d.byte_array) != c for d, c in zip(dst, chunks, strict=True))
    if loaded != len(keys) or wrong:
        raise SystemExit(f"loads: {loaded} of {len(keys)} chunks, {wrong} with other bytes")
    out["store_gbps"] = total / out["store_s"] / 1e9
    out["load_gbps"] = total / out["load_s"] / 1e9
    return out


def _one(adapter: Any, task: int) -> dict[int, Any]:
    got = adapter.query_lookup_and_lock_result(task)
    return {} if got is None else {task: got}


def _loads(adapter: Any, tasks: list[int]) -> dict[int, Any]:
    out = {}
    for t in tasks:
        got = adapter.query_load_result(t)
        if got is not None:
            out[t] = got
    return out


@contextmanager
def targets(lm: Any, workdir: Path, extra: dict[str, str] | None = None) -> Iterator[dict[str, tuple[Any, int | None]]]:
    """Each target's adapter and its daemon's pid (None for fs); ``extra``: more daemon settings."""
    settings = {"durability": "interval", "segment_size": "64MiB", **(extra or {})}
    os.environ.update(UCX)  # for this process's agent, and passed on to the daemon's
    with ExitStack() as stack:
        sock = workdir / "kv.sock"
        nixl = {"nixl": "1", "nixl_devices": "lo"}
        direct = stack.enter_context(daemon(settings | nixl, ["--listen", f"unix:{sock}"], policy="direct"))
        sealed = stack.enter_context(daemon(settings, policy="sealed"))
        made: dict[str, tuple[Any, int | None]] = {}

        def kv(endpoint: str, token: str, **more: str) -> Any:
            params = {"endpoints": endpoint, "token": token, "timeout": 60, **more}
            return make_adapter(lm, {**PLUGIN, "adapter_params": params})

        made["fs"] = (make_adapter(lm, {"type": "fs", "base_path": str(workdir / "fs")}), None)
        made["kvstore-http"] = (kv(direct.base, direct.token), direct.proc.pid)
        made["kvstore-sealed"] = (kv(sealed.base, sealed.token), sealed.proc.pid)
        made["kvstore-unix"] = (kv(f"unix:{sock}", direct.token), direct.proc.pid)
        made["kvstore-nixl"] = (kv(direct.base, direct.token, transport="nixl", nixl_devices="lo"), direct.proc.pid)
        try:
            yield made
        finally:
            for adapter, _ in made.values():
                adapter.close()


def summarize(rounds: dict[str, list[dict[str, float]]], total: int) -> dict[str, Any]:
    gb = total / 1e9
    out: dict[str, Any] = {}
    for name, rs in rounds.items():
        out[name] = {
            "store_gbps": statistics.median(r["store_gbps"] for r in rs),
            "load_gbps": statistics.median(r["load_gbps"] for r in rs),
            "lookup_ms": statistics.median(r["lookup_s"] for r in rs) * 1e3,
            "store_cpu_s_per_gb": statistics.median(r["store_cpu_s"] for r in rs) / gb,
            "load_cpu_s_per_gb": statistics.median(r["load_cpu_s"] for r in rs) / gb,
            "store_daemon_cpu_s_per_gb": statistics.median(r["store_daemon_cpu_s"] for r in rs) / gb,
            "load_daemon_cpu_s_per_gb": statistics.median(r["load_daemon_cpu_s"] for r in rs) / gb,
            "store_x_fs": [r["store_gbps"] / f["store_gbps"] for r, f in zip(rs, rounds["fs"], strict=True)],
            "load_x_fs": [r["load_gbps"] / f["load_gbps"] for r, f in zip(rs, rounds["fs"], strict=True)],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmcache_mp_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=64, help="chunks per round (default 64)")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="MiB per chunk (default 4)")
    p.add_argument("--batch", type=int, default=16, help="chunks per store or load task (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per target (default 3); medians reported")
    p.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    p.add_argument("--samples", type=Path, default=SAMPLES, help="a directory of *.bin KV samples")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each load phase")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a daemon setting (both daemons)")
    args = p.parse_args(argv)
    extra: dict[str, str] = {}
    for item in args.set:
        name, eq, value = item.partition("=")
        if not eq or not name:
            p.error(f"--set {item!r}: expected NAME=VALUE")
        extra[name] = value
    if args.chunks < 1 or args.batch < 1 or args.repeats < 1 or args.chunk_mib <= 0 or args.warmup < 0:
        p.error("--chunks, --batch, --repeats and --chunk-mib must be positive, --warmup not negative")
    size = int(args.chunk_mib * MiB) // 4096 * 4096 or 4096
    lm = _lmcache()
    pool = load_pool(args.samples)
    rng = random.Random(7)
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-mp-bench-", dir="/var/tmp"))
    rounds: dict[str, list[dict[str, float]]] = {t: [] for t in TARGETS}
    dropped = False
    try:
        with targets(lm, workdir, extra) as made:
            for r in range(-args.warmup, args.repeats):
                chunks = cut_objects(pool, size, args.chunks, rng)
                order = TARGETS[r % len(TARGETS) :] + TARGETS[: r % len(TARGETS)]
                for i, name in enumerate(order):
                    adapter, pid = made[name]
                    res = run_target(lm, adapter, chunks, args.batch, (r + args.warmup) * 10 + i, pid, args.drop_caches)
                    if r >= 0:
                        rounds[name].append(res)
                    print(
                        f"{'round ' + str(r + 1) if r >= 0 else 'warm-up':8} {name:15} "
                        f"store {res['store_gbps']:6.2f} GB/s  "
                        f"load {res['load_gbps']:6.2f} GB/s  lookup {res['lookup_s'] * 1e3:6.1f} ms",
                        flush=True,
                    )
            dropped = args.drop_caches and _drop_caches()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = summarize(rounds, size * args.chunks)
    print(f"\n{args.chunks} chunks of {size / MiB:g} MiB, tasks of {args.batch}, {args.repeats} rounds (medians)")
    print(
        f"{'target':15} {'store GB/s':>10} {'load GB/s':>10} {'store x fs':>18} {'load x fs':>18}  cpu s/GB here|daemon"
    )
    for name, s in summary.items():
        sx = "/".join(f"{x:.2f}" for x in s["store_x_fs"])
        lx = "/".join(f"{x:.2f}" for x in s["load_x_fs"])
        print(
            f"{name:15} {s['store_gbps']:10.2f} {s['load_gbps']:10.2f} {sx:>18} {lx:>18}  "
            f"store {s['store_cpu_s_per_gb']:.2f}|{s['store_daemon_cpu_s_per_gb']:.2f} "
            f"load {s['load_cpu_s_per_gb']:.2f}|{s['load_daemon_cpu_s_per_gb']:.2f}"
        )
    doc = {
        "chunks": args.chunks,
        "chunk_bytes": size,
        "batch": args.batch,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "page_cache_dropped": dropped,
        "durability": {"fs": "page cache, no fsync", "kvstore": "interval"},
        "targets": summary,
        "rounds": rounds,
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
