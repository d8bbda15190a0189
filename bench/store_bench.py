"""Throughput and compression of the kvstore engine on real KV-cache blocks.

A benchmark, not a test. For each tenant policy (``sealed``: zstd byte planes +
AES-GCM; ``direct``: raw) and each sample dtype (bf16, fp16) it measures, in
one process and one run:

* put throughput: ``--total`` bytes of ``--block-size`` blocks, written as
  waves of ``--concurrency`` puts gathered with asyncio;
* get throughput, warm (just written: page cache) and cold (the page cache of
  every segment file dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after
  an fsync; fadvise-based, the LMDB index stays warm);
* the compression ratio end to end: logical bytes / stored bytes from
  ``Store.stats`` (record headers and padding included), and logical bytes /
  on-disk size of the segment files;
* the same machine's raw sequential file write (write + fdatasync) and read
  (cold via fadvise, and warm) of the same number of bytes with the same block
  size, and the ratios store/raw.

Every figure is measured ``--repeat`` times (fresh store each time) and the
median is reported; ``--json`` writes the medians and every repeat.
``--profile`` adds a separate cProfile pass over the sealed phases.

Blocks are cut from real KV-cache samples (the package's ``data/kv`` by default) and
reused under distinct keys to reach ``--total``: the store compresses and seals
each record on its own and does not deduplicate, so reuse changes nothing but
how many distinct contents there are.

Run: ``kvstore-store-bench --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import ctypes
import ctypes.util
import functools
import gc
import json
import math
import mmap
import os
import platform
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ParamSpec, TypedDict, TypeVar
from unittest import mock

import kvstore.engine.store as store_mod
from kvstore.config import MiB, StoreConfig, parse_size
from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from kvstore.errors import KVStoreError
from kvstore.tuning import keep_freed_memory

from .samples import SAMPLES

DTYPES = ("bf16", "fp16")
POLICIES = ("sealed", "direct")
GB = 1e9
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
COLD_NOTE = (
    "cold = the page cache of each file dropped with os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) after an fsync "
    "(fadvise-based: the guest's cache only; a host-side cache under the virtual disk may still serve some reads; "
    "the store's LMDB index is left warm)"
)

P = ParamSpec("P")
R = TypeVar("R")
Figures = dict[str, float]


# -- samples ------------------------------------------------------------------


@dataclass(slots=True)
class SampleSet:
    """Blocks cut from the sample files of one dtype."""

    dtype: str
    blocks: list[bytes] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # file name -> blocks taken from it
    skipped: dict[str, str] = field(default_factory=dict)  # file name -> why no blocks came from it


def dtype_of(name: str) -> str | None:
    """The dtype a sample file's name says (``x.bf16.bin``, ``x_kv.f16.bin``), or None."""
    parts = name.lower().split(".")
    if "bf16" in parts:
        return "bf16"
    if "f16" in parts or "fp16" in parts:
        return "fp16"
    return None


def load_samples(directory: Path, block_size: int, dtypes: Sequence[str]) -> dict[str, SampleSet]:
    """Cut every ``*.bin`` sample of the wanted dtypes into whole ``block_size`` blocks
    (a file's tail shorter than a block is left out)."""
    sets = {d: SampleSet(d) for d in dtypes}
    for path in sorted(directory.glob("*.bin")):
        dtype = dtype_of(path.name)
        if dtype not in sets:
            continue
        data = path.read_bytes()
        count = len(data) // block_size
        if count == 0:
            sets[dtype].skipped[path.name] = f"{len(data)} bytes is less than one block"
            continue
        sets[dtype].blocks.extend(data[i * block_size : (i + 1) * block_size] for i in range(count))
        sets[dtype].files[path.name] = count
    return sets


# -- file-system helpers --------------------------------------------------------


def mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, file-system type, device) of the mount that holds ``path``."""
    target = str(path.resolve())
    best = ("/", "unknown", "unknown")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        dev, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, fstype, dev)
    return best


def default_base_dir() -> Path:
    """A directory for the temporary data dirs: the system temp dir if it is on a
    disk (not tmpfs) and on the same file system as the current directory, else
    /var/tmp on the same terms, else the current directory itself. The disk you
    run from is the disk measured, installed or in a checkout alike; what a run
    creates there is removed at its end."""
    here = Path.cwd()
    here_dev = here.stat().st_dev
    for cand in (Path(tempfile.gettempdir()), Path("/var/tmp")):
        with contextlib.suppress(OSError):
            if cand.is_dir() and mount_of(cand)[1] not in MEMORY_FS and cand.stat().st_dev == here_dev:
                return cand
    return here


_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _libc = libc
    return _libc


def resident_pages(path: Path) -> tuple[int, int] | None:
    """(pages in the page cache, pages) of ``path``, by mincore(2); None if unknown."""
    try:
        libc = _get_libc()
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    try:
        size = os.fstat(fd).st_size
        page = mmap.PAGESIZE
        pages = -(-size // page)
        if pages == 0:
            return 0, 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            return sum(b & 1 for b in vec), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def memory_touch_probe(size: int) -> tuple[float, float]:
    """GB/s of filling a fresh anonymous mapping (first touch of its pages), then
    of filling it again. On a VM that hands freed pages back to its host (virtio
    balloon free page reporting), the first figure is what every write into
    recycled memory costs: page-cache writes included."""
    chunk = bytes(1 << 20)
    rates: list[float] = []
    with mmap.mmap(-1, size) as m:
        for _ in range(2):
            t0 = time.perf_counter()
            for off in range(0, size - len(chunk) + 1, len(chunk)):
                m[off : off + len(chunk)] = chunk
            rates.append(size / (time.perf_counter() - t0) / GB)
    return rates[0], rates[1]


def can_drop_cache() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def drop_cache(paths: Sequence[Path]) -> float | None:
    """fsync each file, then drop its page cache with POSIX_FADV_DONTNEED.
    Returns the fraction of their pages still resident afterwards (None: unknown)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    resident = total = 0
    for p in paths:
        r = resident_pages(p)
        if r is None:
            return None
        resident, total = resident + r[0], total + r[1]
    return resident / total if total else 0.0


# -- measurement ------------------------------------------------------------------


@dataclass(slots=True)
class Timing:
    wall: float = 0.0
    cpu: float = 0.0  # process CPU time, all threads

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - w0
            self.cpu += time.process_time() - c0


def waves(n: int, width: int) -> Iterator[range]:
    for lo in range(0, n, width):
        yield range(lo, min(n, lo + width))


def write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def raw_write(path: Path, blocks: Sequence[bytes], n: int, width: int, sync_each_wave: bool) -> Timing:
    """Write ``n`` blocks sequentially; fdatasync after every wave of ``width``
    blocks (like the store's group commit under ``fsync``) or once at the end."""
    t = Timing()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with t.measure():
            offset = 0
            for wave in waves(n, width):
                for i in wave:
                    block = blocks[i % len(blocks)]
                    write_all(fd, memoryview(block), offset)
                    offset += len(block)
                if sync_each_wave:
                    os.fdatasync(fd)
            os.fdatasync(fd)
    finally:
        os.close(fd)
    return t


def raw_read(path: Path, block_size: int, fresh: bool = False) -> Timing:
    """Read the whole file sequentially, one block at a time, into one reused
    buffer (the machine's ceiling) or, with ``fresh``, into a new bytearray per
    block (what a get has to return)."""
    t = Timing()
    view = memoryview(bytearray(block_size))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with t.measure():
            offset = 0
            while offset < size:
                if fresh:
                    view = memoryview(bytearray(min(block_size, size - offset)))
                got = os.preadv(fd, [view], offset)
                if got == 0:
                    raise OSError(f"{path}: unexpected end of file at {offset}")
                offset += got
    finally:
        os.close(fd)
    return t


def histogram_totals(metrics_text: str, name: str) -> tuple[float, float]:
    """(sum, count) of an unlabelled histogram in Prometheus text."""
    total = count = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(f"{name}_sum "):
            total = float(line.split()[1])
        elif line.startswith(f"{name}_count "):
            count = float(line.split()[1])
    return total, count


@dataclass(slots=True)
class Options:
    block_size: int
    total: int
    concurrency: int
    durability: str
    dtypes: list[str]
    policies: list[str]
    get_order: str
    verify: bool
    cold: bool
    overrides: dict[str, str]
    n_blocks: int = 0


class Bench:
    """One store under a data dir; runs the phases of each (policy, dtype) tenant."""

    def __init__(self, store: Store, opts: Options, samples: dict[str, SampleSet], tag: str) -> None:
        self.store = store
        self.opts = opts
        self.samples = samples
        self.tag = tag

    def segment_files(self, tenant: str) -> list[Path]:
        return sorted((Path(self.store.config.data_dir) / "segments" / tenant).glob("*.seg"))

    async def put_phase(self, tenant: str, keys: list[str], blocks: list[bytes]) -> Timing:
        t = Timing()
        with t.measure():
            for wave in waves(len(keys), self.opts.concurrency):
                done = await asyncio.gather(*(self.store.put(tenant, keys[i], blocks[i]) for i in wave))
                if not all(s.created for s in done):
                    raise RuntimeError(f"tenant {tenant}: a put found its key already present")
        return t

    async def get_phase(self, tenant: str, keys: list[str], blocks: list[bytes], order: list[int]) -> Timing:
        t = Timing()
        for wave in waves(len(order), self.opts.concurrency):
            idx = [order[i] for i in wave]
            with t.measure():
                outs = await asyncio.gather(*(self.store.get(tenant, keys[i]) for i in idx))
            if self.opts.verify:  # outside the clock
                for i, out in zip(idx, outs, strict=True):
                    if out != blocks[i]:
                        raise RuntimeError(f"tenant {tenant}: key {keys[i]} read back different bytes")
        return t

    async def run_tenant(
        self, policy: str, dtype: str, figs: Figures, rng: random.Random, on_phase: PhaseHook | None = None
    ) -> None:
        o = self.opts
        tenant = f"{policy}-{dtype}"
        await self.store.create_tenant(tenant, policy)
        pool = self.samples[dtype].blocks
        keys = [f"{self.tag}-{dtype}-{i:07d}" for i in range(o.n_blocks)]
        blocks = [pool[i % len(pool)] for i in range(o.n_blocks)]
        order = list(range(o.n_blocks))
        if o.get_order == "shuffle":
            rng.shuffle(order)
        nbytes = sum(len(b) for b in blocks)
        pre = f"{policy}.{dtype}."

        gc.collect()
        m0 = self.store.metrics.render()
        with phase(on_phase, "put"):
            put = await self.put_phase(tenant, keys, blocks)
        m1 = self.store.metrics.render()
        figs[pre + "put_gbps"] = nbytes / put.wall / GB
        figs[pre + "put_cpu_cores"] = put.cpu / put.wall
        (bs0, bc0), (bs1, bc1) = (
            histogram_totals(m0, "kvstore_batch_records"),
            histogram_totals(m1, "kvstore_batch_records"),
        )
        (fs0, fc0), (fs1, fc1) = (
            histogram_totals(m0, "kvstore_fsync_seconds"),
            histogram_totals(m1, "kvstore_fsync_seconds"),
        )
        if bc1 > bc0:
            figs[pre + "put_batches"] = bc1 - bc0
            figs[pre + "put_records_per_batch"] = (bs1 - bs0) / (bc1 - bc0)
        if fc1 > fc0:
            figs[pre + "put_fsyncs"] = fc1 - fc0
            figs[pre + "put_fsync_ms_mean"] = (fs1 - fs0) / (fc1 - fc0) * 1e3
            figs[pre + "put_fsync_share"] = (fs1 - fs0) / put.wall

        gc.collect()
        with phase(on_phase, "get warm"):
            warm = await self.get_phase(tenant, keys, blocks, order)
        figs[pre + "get_warm_gbps"] = nbytes / warm.wall / GB
        figs[pre + "get_warm_cpu_cores"] = warm.cpu / warm.wall

        if o.cold:
            gc.collect()
            resident = drop_cache(self.segment_files(tenant))
            if resident is not None:
                figs[pre + "cold_resident_after_drop"] = resident
            with phase(on_phase, "get cold"):
                cold = await self.get_phase(tenant, keys, blocks, order)
            figs[pre + "get_cold_gbps"] = nbytes / cold.wall / GB
            figs[pre + "get_cold_cpu_cores"] = cold.cpu / cold.wall

        st = await self.store.stats(tenant)
        files = self.segment_files(tenant)
        on_disk = sum(p.stat().st_size for p in files)
        allocated = sum(p.stat().st_blocks * 512 for p in files)
        figs[pre + "blocks"] = st.blocks
        figs[pre + "logical_bytes"] = st.logical_bytes
        figs[pre + "stored_bytes"] = st.stored_bytes
        figs[pre + "on_disk_bytes"] = on_disk
        figs[pre + "allocated_bytes"] = allocated
        figs[pre + "segments"] = len(files)
        figs[pre + "ratio_stored"] = st.logical_bytes / st.stored_bytes
        figs[pre + "ratio_on_disk"] = st.logical_bytes / on_disk


PhaseHook = Callable[[str], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def phase(hook: PhaseHook | None, name: str) -> Iterator[None]:
    if hook is None:
        yield
    else:
        with hook(name):
            yield


def store_config(root: Path, opts: Options) -> StoreConfig:
    # env={}: KVSTORE_* variables of the caller's shell do not leak into the figures.
    overrides: dict[str, Any] = {"durability": opts.durability, **opts.overrides}
    return StoreConfig.from_env(root, env={}, **overrides)


async def store_repeat(root: Path, opts: Options, samples: dict[str, SampleSet], rep: int, figs: Figures) -> None:
    store = await Store.open(store_config(root, opts), MasterKey(os.urandom(32)))
    try:
        bench = Bench(store, opts, samples, f"r{rep}")
        rng = random.Random(1000 + rep)
        for policy in opts.policies:
            for dtype in opts.dtypes:
                await bench.run_tenant(policy, dtype, figs, rng)
    finally:
        await store.close()


def raw_repeat(path: Path, opts: Options, samples: dict[str, SampleSet], figs: Figures) -> None:
    blocks = [b for d in opts.dtypes for b in samples[d].blocks]
    nbytes = opts.n_blocks * opts.block_size
    gc.collect()
    w = raw_write(path, blocks, opts.n_blocks, opts.concurrency, opts.durability == "fsync")
    figs["raw.write_gbps"] = nbytes / w.wall / GB
    figs["raw.write_cpu_cores"] = w.cpu / w.wall
    if opts.cold:
        resident = drop_cache([path])
        if resident is not None:
            figs["raw.cold_resident_after_drop"] = resident
        c = raw_read(path, opts.block_size)
        figs["raw.read_cold_gbps"] = nbytes / c.wall / GB
        figs["raw.read_cold_cpu_cores"] = c.cpu / c.wall
    r = raw_read(path, opts.block_size)
    figs["raw.read_warm_gbps"] = nbytes / r.wall / GB
    figs["raw.read_warm_cpu_cores"] = r.cpu / r.wall
    f = raw_read(path, opts.block_size, fresh=True)
    figs["raw.read_warm_fresh_gbps"] = nbytes / f.wall / GB
    path.unlink()


def add_ratios(figs: Figures, opts: Options) -> None:
    """Store / raw of the same repeat (so both saw the same machine load)."""
    pairs = (
        ("put_gbps", "raw.write_gbps"),
        ("get_warm_gbps", "raw.read_warm_gbps"),
        ("get_cold_gbps", "raw.read_cold_gbps"),
    )
    for policy in opts.policies:
        for dtype in opts.dtypes:
            for mine, raw in pairs:
                k = f"{policy}.{dtype}.{mine}"
                if k in figs and raw in figs:
                    figs[f"{policy}.{dtype}.{mine.removesuffix('_gbps')}_vs_raw"] = figs[k] / figs[raw]


def medians(repeats: list[Figures]) -> Figures:
    keys = sorted({k for r in repeats for k in r})
    return {k: statistics.median([r[k] for r in repeats if k in r]) for k in keys}


# -- profiling --------------------------------------------------------------------


class PhaseProfiler:
    """cProfile per thread and per phase: the event-loop thread, and every call the
    store's executor runs while a phase is active (see ProfilingExecutor)."""

    def __init__(self, clock: str) -> None:
        self._timer: Callable[[], float] = time.thread_time if clock == "cpu" else time.perf_counter
        self._phase: str | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self.profiles: dict[str, list[cProfile.Profile]] = {}
        self.walls: dict[str, float] = {}
        self.unprofiled_calls = 0

    def _profile(self, name: str) -> cProfile.Profile:
        mine: dict[str, cProfile.Profile] = self._local.__dict__.setdefault("p", {})
        prof = mine.get(name)
        if prof is None:
            prof = mine[name] = cProfile.Profile(self._timer)
            with self._lock:
                self.profiles.setdefault(name, []).append(prof)
        return prof

    def wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            name = self._phase
            if name is None:
                return fn(*args, **kwargs)
            prof = self._profile(name)
            try:
                prof.enable()
            except ValueError:  # Python >= 3.12: one profiler at a time (sys.monitoring)
                self.unprofiled_calls += 1
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                prof.disable()

        return run

    @contextlib.contextmanager
    def active(self, name: str) -> Iterator[None]:
        prof = self._profile(name)
        self._phase = name
        t0 = time.perf_counter()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            self._phase = None
            self.walls[name] = self.walls.get(name, 0.0) + time.perf_counter() - t0

    def stats(self, name: str) -> pstats.Stats | None:
        merged: pstats.Stats | None = None
        for prof in self.profiles.get(name, []):
            prof.create_stats()
            if not getattr(prof, "stats", None):
                continue
            if merged is None:
                merged = pstats.Stats(prof)
            else:
                merged.add(prof)
        return merged


class ProfilingExecutor(ThreadPoolExecutor):
    """The store's executor, with each submitted call profiled by ``profiler``."""

    def __init__(self, profiler: PhaseProfiler, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._profiler = profiler

    def submit(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        return super().submit(self._profiler.wrap(fn), *args, **kwargs)


FuncKey = tuple[str, int, str]

# (category, test on "file:function"), first match wins. Times are each function's
# own time (tottime); C work done inline in a Python function (numpy strided copies,
# bytearray allocation, slicing copies) counts in that function.
CATEGORIES: list[tuple[str, Callable[[str, str], bool]]] = [
    ("zstd (de)compress", lambda f, n: "zstd" in n.lower()),
    ("AES-GCM", lambda f, n: "encrypt_into" in n or "decrypt_into" in n or "AESGCM" in n),
    ("HKDF / per-record key", lambda f, n: "hkdf" in f.lower() or "derive" in n or "hashes" in f),
    ("xxh3 checksum", lambda f, n: "xxh" in n.lower()),
    (
        "numpy byte planes (codec.py)",
        lambda f, n: f.endswith("kvstore/engine/codec.py") or "numpy" in n or "numpy" in f,
    ),
    ("pwritev", lambda f, n: "pwrite" in n),
    ("fdatasync / fsync", lambda f, n: "fsync" in n or "fdatasync" in n),
    ("preadv", lambda f, n: "pread" in n),
    (
        "LMDB (index.py + lmdb)",
        lambda f, n: (
            f.endswith("kvstore/engine/index.py")
            or "lmdb" in (f + n).lower()
            or any(f"'{t}'" in n for t in ("Transaction", "Environment", "Cursor", "_Database"))
        ),
    ),
    ("event loop idle (epoll wait)", lambda f, n: "epoll" in n),
    ("bytes copies (join, bytes())", lambda f, n: "of 'bytes' objects" in n or "of 'bytearray' objects" in n),
    (
        "asyncio / threads plumbing",
        lambda f, n: (
            any(s in f for s in ("asyncio", "concurrent", "threading", "selectors", "functools"))
            or any(s in n for s in ("_socket", "_thread", "_contextvars", "_asyncio", "collections.deque"))
        ),
    ),
    ("kvstore other Python (copies, allocations)", lambda f, n: "/kvstore/" in f),
    ("bench driver", lambda f, n: "/bench/" in f),
]


def func_label(key: FuncKey) -> str:
    file, line, name = key
    if file == "~":
        return name
    parts = Path(file).parts
    return f"{'/'.join(parts[-2:])}:{line}({name})"


def category_of(key: FuncKey) -> str:
    file, _, name = key
    for cat, test in CATEGORIES:
        if test(file.replace("\\", "/"), name):
            return cat
    return "other"


class ProfileRow(TypedDict):
    function: str
    category: str
    ncalls: int
    tottime: float
    cumtime: float


def summarize_profile(stats: pstats.Stats, top: int) -> dict[str, Any]:
    raw: dict[FuncKey, tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    rows = [
        ProfileRow(function=func_label(k), category=category_of(k), ncalls=nc, tottime=tt, cumtime=ct)
        for k, (_cc, nc, tt, ct, _callers) in raw.items()
    ]
    cats: dict[str, float] = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0.0) + r["tottime"]
    return {
        "total_tottime": sum(r["tottime"] for r in rows),
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top_cumulative": sorted(rows, key=lambda r: -r["cumtime"])[:top],
        "top_tottime": sorted(rows, key=lambda r: -r["tottime"])[:top],
    }


async def profile_pass(
    root: Path, opts: Options, samples: dict[str, SampleSet], profiler: PhaseProfiler, figs: Figures
) -> None:
    factory = functools.partial(ProfilingExecutor, profiler)
    with mock.patch.object(store_mod, "ThreadPoolExecutor", factory):
        store = await Store.open(store_config(root, opts), MasterKey(os.urandom(32)))
    try:
        bench = Bench(store, opts, samples, "prof")
        for dtype in opts.dtypes:
            await bench.run_tenant("sealed", dtype, figs, random.Random(7), profiler.active)
    finally:
        await store.close()


# -- output -----------------------------------------------------------------------


def fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None or math.isnan(v) else format(v, spec)


def render_tables(med: Figures, repeats: list[Figures], opts: Options) -> str:
    out: list[str] = []
    rows = [(p, d) for p in opts.policies for d in opts.dtypes]
    name_w = 34

    def line(label: str, vals: Sequence[str], w: int = 11) -> str:
        return f"  {label:<{name_w}}" + "".join(f"{v:>{w}}" for v in vals)

    g = med.get
    n = len(repeats)
    cold_h = "get cold*" if opts.cold else "get cold"
    out.append(f"Throughput, GB/s of logical bytes (1 GB = 1e9 B), median of {n}")
    out.append(line("", ["put", "get warm", cold_h]))
    for p, d in rows:
        pre = f"{p}.{d}."
        out.append(
            line(f"{p} {d}", [fmt(g(pre + "put_gbps")), fmt(g(pre + "get_warm_gbps")), fmt(g(pre + "get_cold_gbps"))])
        )
    out.append(
        line(
            "raw file (sequential, 1 thread)",
            [fmt(g("raw.write_gbps")), fmt(g("raw.read_warm_gbps")), fmt(g("raw.read_cold_gbps"))],
        )
    )
    out.append(line("raw file, new buffer per block", ["", fmt(g("raw.read_warm_fresh_gbps")), ""]))
    out.append("")
    out.append("Store / raw file (ratio within each repeat, then median)")
    out.append(line("", ["put/write", "warm/warm", "cold/cold"]))
    for p, d in rows:
        pre = f"{p}.{d}."
        out.append(
            line(
                f"{p} {d}",
                [
                    fmt(g(pre + "put_vs_raw"), ".2f"),
                    fmt(g(pre + "get_warm_vs_raw"), ".2f"),
                    fmt(g(pre + "get_cold_vs_raw"), ".2f"),
                ],
            )
        )
    out.append("")
    out.append(f"CPU: cores busy = process CPU seconds / wall seconds (this machine has {os.cpu_count()})")
    out.append(line("", ["put", "get warm", "get cold"]))
    for p, d in rows:
        pre = f"{p}.{d}."
        out.append(
            line(
                f"{p} {d}",
                [fmt(g(pre + k), ".2f") for k in ("put_cpu_cores", "get_warm_cpu_cores", "get_cold_cpu_cores")],
            )
        )
    out.append(
        line(
            "raw file",
            [fmt(g("raw." + k), ".2f") for k in ("write_cpu_cores", "read_warm_cpu_cores", "read_cold_cpu_cores")],
        )
    )
    out.append("")
    out.append("Group commit during put (median)")
    out.append(line("", ["batches", "recs/batch", "fsyncs", "fsync ms", "fsync/wall"]))
    for p, d in rows:
        pre = f"{p}.{d}."
        out.append(
            line(
                f"{p} {d}",
                [
                    fmt(g(pre + "put_batches"), ".0f"),
                    fmt(g(pre + "put_records_per_batch"), ".1f"),
                    fmt(g(pre + "put_fsyncs"), ".0f"),
                    fmt(g(pre + "put_fsync_ms_mean"), ".1f"),
                    fmt(g(pre + "put_fsync_share"), ".0%"),
                ],
            )
        )
    out.append("")
    out.append("Compression end to end (logical / stored; stored = records with headers and padding)")
    out.append(line("", ["logical MiB", "stored MiB", "on disk MiB", "log/stored", "log/disk", "segments"], 12))
    for p, d in rows:
        pre = f"{p}.{d}."
        mib = [
            fmt(None if g(pre + k) is None else g(pre + k, 0.0) / MiB, ".1f")
            for k in ("logical_bytes", "stored_bytes", "on_disk_bytes")
        ]
        out.append(
            line(
                f"{p} {d}",
                [
                    *mib,
                    fmt(g(pre + "ratio_stored"), ".4f"),
                    fmt(g(pre + "ratio_on_disk"), ".4f"),
                    fmt(g(pre + "segments"), ".0f"),
                ],
                12,
            )
        )
    if n > 1:
        out.append("")
        out.append(f"Spread over the {n} repeats, GB/s: min .. max")
        out.append(line("", ["put", "get warm", "get cold"], 16))

        def spread(k: str) -> str:
            vs = [r[k] for r in repeats if k in r]
            return f"{min(vs):.3f}..{max(vs):.3f}" if vs else "-"

        for p, d in rows:
            pre = f"{p}.{d}."
            out.append(line(f"{p} {d}", [spread(pre + k) for k in ("put_gbps", "get_warm_gbps", "get_cold_gbps")], 16))
        out.append(
            line("raw file", [spread("raw." + k) for k in ("write_gbps", "read_warm_gbps", "read_cold_gbps")], 16)
        )
    if opts.cold:
        res = [v for k, v in med.items() if k.endswith("cold_resident_after_drop")]
        out.append("")
        out.append(f"* {COLD_NOTE}.")
        if res:
            out.append(f"  Pages still resident right after the drop (mincore): at most {max(res):.1%}.")
    return "\n".join(out)


PROFILE_PHASES = ("put", "get warm", "get cold")


def run_profile(root: Path, opts: Options, samples: dict[str, SampleSet], clock: str, top: int) -> dict[str, Any]:
    """Profile the sealed phases once per clock (a fresh store each time); print and return the summaries."""
    popts = Options(**{**{f.name: getattr(opts, f.name) for f in fields(opts)}, "policies": ["sealed"]})
    popts.verify = False  # keep the comparison out of the profile
    clocks = ["wall", "cpu"] if clock == "both" else [clock]
    result: dict[str, Any] = {"clocks": clocks, "phases": {name: {} for name in PROFILE_PHASES}}
    unprofiled = 0
    for c in clocks:
        profiler = PhaseProfiler(c)
        figs: Figures = {}
        asyncio.run(profile_pass(root / f"profile-{c}", popts, samples, profiler, figs))
        unprofiled += profiler.unprofiled_calls
        for name in PROFILE_PHASES:
            st = profiler.stats(name)
            if st is None:
                continue
            summary = summarize_profile(st, top)
            wall = profiler.walls.get(name, 0.0)
            summary["wall_seconds"] = wall
            summary["profiled_gbps"] = len(opts.dtypes) * opts.n_blocks * opts.block_size / wall / GB if wall else None
            result["phases"][name][c] = summary
    for name in PROFILE_PHASES:
        if result["phases"][name]:
            print()
            print(render_profile(name, result["phases"][name]))
    if unprofiled:
        print(f"note: {unprofiled} executor calls could not be profiled (one profiler at a time on Python >= 3.12)")
    return result


def render_profile(name: str, by_clock: dict[str, dict[str, Any]]) -> str:
    clocks = list(by_clock)
    runs = "; ".join(
        f"{c} clock: {s['wall_seconds']:.2f} s wall, {fmt(s['profiled_gbps'])} GB/s" for c, s in by_clock.items()
    )
    out = [
        f"Profile of sealed {name}, all dtypes, under cProfile ({runs}).",
        "  Own time (tottime) summed over the event-loop thread and the store's executor threads.",
    ]
    if "wall" in clocks:
        out.append("  wall: elapsed time; a call that releases the GIL is also charged the wait to take it back.")
    if "cpu" in clocks:
        out.append("  cpu: thread CPU time (time.thread_time): no I/O, lock or GIL waits.")
    cats: list[str] = []
    for s in by_clock.values():
        cats.extend(k for k in s["categories"] if k not in cats)
    head = "".join(f"{c + ' s':>10}{'%':>7}" for c in clocks)
    out.append(f"  {'where the time goes':<46}{head}")
    for cat in cats:
        cells = ""
        for c in clocks:
            t = float(by_clock[c]["categories"].get(cat, 0.0))
            cells += f"{t:>10.3f}{t / (float(by_clock[c]['total_tottime']) or 1.0):>7.1%}"
        out.append(f"    {cat:<44}{cells}")
    for c in clocks:
        s = by_clock[c]
        for title, key in (("cumulative", "top_cumulative"), ("own (total)", "top_tottime")):
            out.append(f"  top functions by {title} time, {c} clock:")
            out.append(f"    {'ncalls':>8} {'tottime':>9} {'cumtime':>9}  function")
            for r in s[key]:
                out.append(f"    {r['ncalls']:>8} {r['tottime']:>9.3f} {r['cumtime']:>9.3f}  {r['function']}")
    return "\n".join(out)


# -- main -------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvstore-store-bench",
        description="Throughput and compression of the kvstore engine on real KV-cache blocks (see bench/README.md).",
    )
    p.add_argument(
        "--samples",
        type=Path,
        default=SAMPLES,
        help="directory of *.bf16*.bin / *.f16*.bin samples (default: the ones shipped here)",
    )
    p.add_argument("--block-size", default="2MiB", help="block size (default 2MiB)")
    p.add_argument("--total", default="256MiB", help="bytes per phase and tenant (default 256MiB)")
    p.add_argument("--concurrency", type=int, default=8, help="puts/gets in flight per wave (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="repeats; medians are reported (default 3)")
    p.add_argument("--durability", choices=("fsync", "interval"), default="fsync", help="store durability policy")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: bf16,fp16")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated: sealed,direct")
    p.add_argument("--get-order", choices=("seq", "shuffle"), default="seq", help="order of gets (default: as written)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="StoreConfig override, repeatable")
    p.add_argument("--dir", type=Path, help="where to create the temporary data dir (default: a disk-backed temp dir)")
    p.add_argument(
        "--warmup",
        default="total",
        help="bytes to write, fsync and delete before the first repeat, untimed (default: --total; 0: none)",
    )
    p.add_argument("--keep", action="store_true", help="keep the data dir")
    p.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="leave glibc's defaults (the daemon calls kvstore.tuning.keep_freed_memory at start)",
    )
    p.add_argument("--no-cold", action="store_true", help="skip the cold (fadvise) reads")
    p.add_argument("--no-verify", action="store_true", help="do not compare the bytes read with the bytes written")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure (medians and repeats) as JSON")
    p.add_argument("--profile", action="store_true", help="add a cProfile pass over the sealed put and get phases")
    p.add_argument("--profile-top", type=int, default=12, help="functions listed per profile table (default 12)")
    p.add_argument(
        "--profile-clock",
        choices=("wall", "cpu", "both"),
        default="both",
        help="cProfile timer: elapsed time, thread CPU time, or one pass with each (default both)",
    )
    return p.parse_args(argv)


def build_options(a: argparse.Namespace) -> Options:
    def csv(value: str, allowed: Sequence[str], what: str) -> list[str]:
        items = [x.strip() for x in value.split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            raise ValueError(f"--{what}={value!r}: expected a comma-separated subset of {','.join(allowed)}")
        return list(dict.fromkeys(items))

    block = parse_size("--block-size", a.block_size)
    total = parse_size("--total", a.total)
    if block < 1 or total < block:
        raise ValueError(f"--total ({total}) must be at least --block-size ({block}), which must be positive")
    if a.concurrency < 1 or a.repeat < 1:
        raise ValueError("--concurrency and --repeat must be at least 1")
    overrides: dict[str, str] = {}
    for item in a.set:
        k, sep, v = item.partition("=")
        if not sep or k in ("data_dir", "durability"):
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE for a StoreConfig field (not data_dir/durability)")
        overrides[k.strip()] = v.strip()
    return Options(
        block_size=block,
        total=total,
        concurrency=a.concurrency,
        durability=a.durability,
        dtypes=csv(a.dtypes, DTYPES, "dtypes"),
        policies=csv(a.policies, POLICIES, "policies"),
        get_order=a.get_order,
        verify=not a.no_verify,
        cold=not a.no_cold and can_drop_cache(),
        overrides=overrides,
        n_blocks=total // block,
    )


@dataclass(slots=True)
class Context:
    """What a run found out about its machine before measuring."""

    root: Path
    fs: tuple[str, str, str]  # mount point, type, device
    config: StoreConfig
    loadavg_start: tuple[float, float, float]
    memory_touch: tuple[float, float]


def prepare(a: argparse.Namespace, opts: Options, samples: dict[str, SampleSet]) -> Context | str:
    """Create the data dir and print the run's header; a str is a reason not to run."""
    empty = [d for d in opts.dtypes if not samples[d].blocks]
    if empty:
        return f"no {'/'.join(empty)} sample of at least one block ({opts.block_size} B) in {a.samples}"
    base = a.dir if a.dir is not None else default_base_dir()
    base.mkdir(parents=True, exist_ok=True)
    mnt, fstype, dev = mount_of(base)
    per_repeat = (len(opts.dtypes) * len(opts.policies) + 1) * opts.n_blocks * (opts.block_size + 64 * 1024)
    free = shutil.disk_usage(base).free
    if free < per_repeat * 1.2:
        return f"{base} has {free / MiB:.0f} MiB free; a repeat needs about {per_repeat / MiB:.0f} MiB"
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=base))
    cfg = store_config(root / "store", opts)
    nbytes = opts.n_blocks * opts.block_size
    print(
        f"kvstore store benchmark: {opts.n_blocks} blocks of {opts.block_size / MiB:g} MiB "
        f"({nbytes / MiB:g} MiB) per phase and tenant, concurrency {opts.concurrency} (asyncio.gather waves), "
        f"durability {opts.durability}, gets in {opts.get_order} order, {a.repeat} repeat(s), medians"
    )
    print(f"data dir: {root} ({fstype} on {dev}, mounted at {mnt})")
    if fstype in MEMORY_FS:
        print(f"WARNING: {root} is on {fstype} (memory): disk figures are meaningless here")
    print(
        f"store config: frame_size {cfg.frame_size / MiB:g} MiB, compression {cfg.compression} level {cfg.zstd_level}, "
        f"segment_size {cfg.segment_size / MiB:g} MiB, io_threads {cfg.io_threads}, max_batch_bytes "
        f"{cfg.max_batch_bytes / MiB:g} MiB"
    )
    print(f"samples: {a.samples}")
    for d in opts.dtypes:
        s = samples[d]
        files = ", ".join(f"{f} x{c}" for f, c in s.files.items())
        skipped = "".join(f"; skipped {f} ({why})" for f, why in s.skipped.items())
        print(f"  {d}: {len(s.blocks)} distinct blocks ({files}){skipped}; reused round-robin under distinct keys")
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    touch = memory_touch_probe(max(1, min(opts.total, 256 * MiB) // MiB) * MiB)
    print(
        f"memory: filling fresh pages {touch[0]:.2f} GB/s, the same pages again {touch[1]:.2f} GB/s "
        "(a large gap: writes into recycled memory pay for first touches; see bench/README.md)"
    )
    if not opts.cold:
        print("cold reads: skipped" + ("" if a.no_cold else " (posix_fadvise is not available here)"))
    print(flush=True)
    return Context(root, (mnt, fstype, dev), cfg, load, touch)


def warm_up(ctx: Context, opts: Options, samples: dict[str, SampleSet], size: int) -> None:
    """Write, sync and delete ``size`` bytes, untimed. On a VM that returns freed
    pages to its host, the first writes of a run pay for first touches of guest
    memory (the first repeat's raw write was often 3-5x slower without this)."""
    if size < opts.block_size:
        return
    blocks = [b for d in opts.dtypes for b in samples[d].blocks]
    path = ctx.root / "warmup.bin"
    w = raw_write(path, blocks, size // opts.block_size, opts.concurrency, True)
    path.unlink()
    print(f"warm-up: wrote, synced and deleted {size / MiB:g} MiB in {w.wall:.2f} s (untimed)", flush=True)


def json_doc(
    a: argparse.Namespace, opts: Options, samples: dict[str, SampleSet], ctx: Context, repeats: list[Figures]
) -> dict[str, Any]:
    mnt, fstype, dev = ctx.fs
    return {
        "benchmark": "kvstore store_bench",
        "units": {"*_gbps": "1e9 logical bytes per second", "*_cpu_cores": "process CPU s / wall s"},
        "cold_method": COLD_NOTE if opts.cold else "skipped",
        "options": {
            "block_size": opts.block_size,
            "blocks_per_phase": opts.n_blocks,
            "bytes_per_phase": opts.n_blocks * opts.block_size,
            "concurrency": opts.concurrency,
            "durability": opts.durability,
            "dtypes": opts.dtypes,
            "policies": opts.policies,
            "get_order": opts.get_order,
            "repeat": a.repeat,
            "samples": str(a.samples),
            "store_config_overrides": opts.overrides,
            "verify": opts.verify,
        },
        "store_config": {f.name: getattr(ctx.config, f.name) for f in fields(ctx.config) if f.name != "data_dir"},
        "environment": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "data_dir_fs": {"type": fstype, "device": dev, "mount": mnt},
            "loadavg_start": ctx.loadavg_start,
            "loadavg_end": os.getloadavg(),
            "memory_first_touch_gbps": ctx.memory_touch[0],
            "memory_retouch_gbps": ctx.memory_touch[1],
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        },
        "samples": {d: {"distinct_blocks": len(samples[d].blocks), "files": samples[d].files} for d in opts.dtypes},
        "median": medians(repeats),
        "repeats": repeats,
    }


def run(a: argparse.Namespace) -> int:
    opts = build_options(a)
    store_config(Path("unused"), opts)  # refuse a bad --set before doing anything
    warmup = opts.total if a.warmup == "total" else parse_size("--warmup", a.warmup)
    samples = load_samples(a.samples, opts.block_size, opts.dtypes)
    ctx = prepare(a, opts, samples)
    if isinstance(ctx, str):
        print(f"store_bench: {ctx}", file=sys.stderr)
        return 2
    repeats: list[Figures] = []
    profile: dict[str, Any] | None = None
    try:
        warm_up(ctx, opts, samples, warmup)
        for rep in range(a.repeat):
            figs: Figures = {}
            t0 = time.perf_counter()
            rep_dir = ctx.root / f"repeat-{rep}"
            rep_dir.mkdir()
            raw_repeat(rep_dir / "raw.bin", opts, samples, figs)
            asyncio.run(store_repeat(rep_dir / "store", opts, samples, rep, figs))
            add_ratios(figs, opts)
            repeats.append(figs)
            if not a.keep:
                shutil.rmtree(rep_dir)
            print(f"repeat {rep + 1}/{a.repeat} done in {time.perf_counter() - t0:.1f} s", flush=True)
        print()
        print(render_tables(medians(repeats), repeats, opts))
        if a.profile:
            profile = run_profile(ctx.root, opts, samples, a.profile_clock, a.profile_top)
    finally:
        if a.keep:
            print(f"kept: {ctx.root}")
        else:
            shutil.rmtree(ctx.root, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nload average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if a.json is not None:
        doc = json_doc(a, opts, samples, ctx, repeats)
        doc["profile"] = profile
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    tuned = False if args.no_malloc_tuning else keep_freed_memory()
    print(f"malloc tuning (keep freed memory, as the daemon does): {'on' if tuned else 'off'}")
    try:
        return run(args)
    except (ValueError, KVStoreError) as e:
        print(f"store_bench: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
