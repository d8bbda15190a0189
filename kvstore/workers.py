"""How many processes ``workers = "auto"`` starts: one per CPU this process
may run on, as many as memory can hold at their peak, at most
:data:`MAX_WORKERS`, at least one.

:func:`auto_workers` is the rule, on numbers passed in; :func:`machine_workers`
reads them off this machine (the CPU affinity mask, ``MemAvailable`` in
/proc/meminfo, the cgroup's memory limit) for a configuration. server.py
resolves ``auto`` once at start-up, before it forks, and logs the figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import MiB
from kvstore.server_config import ServerConfig

# Every reader relays its writes and admin calls to the one writer, and opens
# its own LMDB environment and segment files: past a few dozen processes the
# writer and those, not the CPUs, set the pace (a judgement, not measured).
MAX_WORKERS = 64
# What a worker holds besides the request bodies it buffers: the interpreter
# and its libraries (aiohttp, uvloop, numpy, zstd, LMDB: about 64 MiB resident
# at idle, measured), the read path's buffers and the aligned buffers kept
# idle for reuse (kvstore/buffers.py). A margin, not an accounting.
WORKER_BASE_BYTES = 256 * MiB


def memory_per_worker(cfg: ServerConfig) -> int:
    """The memory one worker may use at its peak: the request bodies it may
    hold (``max_buffered_body_bytes``, a limit per process) plus the base."""
    return cfg.max_buffered_body_bytes + WORKER_BASE_BYTES


@dataclass(frozen=True, slots=True)
class AutoWorkers:
    """What ``auto`` resolved to, and from what."""

    count: int
    cpus: int
    memory_allows: int | None  # workers the memory holds; None: memory unknown

    def __str__(self) -> str:
        allows = "unknown" if self.memory_allows is None else self.memory_allows
        return f"workers = auto: {self.count} (cpus {self.cpus}, memory allows {allows})"


def auto_workers(cpus: int, memory: int | None, per_worker: int) -> AutoWorkers:
    """One worker per CPU (``cpus``), no more than ``memory`` bytes hold at
    ``per_worker`` bytes each (``memory`` None: unknown, no bound), no more
    than MAX_WORKERS, and at least one whatever the figures."""
    allows = None if memory is None else max(0, memory) // max(1, per_worker)
    count = min(cpus, MAX_WORKERS) if allows is None else min(cpus, MAX_WORKERS, allows)
    return AutoWorkers(max(1, count), cpus, allows)


def machine_workers(cfg: ServerConfig) -> AutoWorkers:
    """:func:`auto_workers` for ``cfg`` on this machine."""
    return auto_workers(cpu_count(), available_memory(), memory_per_worker(cfg))


def cpu_count() -> int:
    """CPUs this process may run on: its affinity mask, which taskset,
    cpusets and systemd's CPUAffinity=/AllowedCPUs= narrow; the machine's
    CPUs where there is no mask (not Linux)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still use: ``MemAvailable``, or the memory
    limit of its cgroup (or of one above it) where that is lower; None where
    neither is known."""
    figures = (mem_available(proc / "meminfo"), cgroup_memory_limit(proc / "self" / "cgroup", cgroup_root))
    return min((n for n in figures if n is not None), default=None)


def mem_available(meminfo: Path) -> int | None:
    """``MemAvailable`` of /proc/meminfo, in bytes."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        fields = value.split()
        if name == "MemAvailable" and fields and fields[0].isdigit():
            return int(fields[0]) * 1024  # the file's unit is kB (KiB)
    return None


def cgroup_memory_limit(self_cgroup: Path, root: Path) -> int | None:
    """The lowest memory limit of this process's cgroup and the cgroups above
    it (a slice's limit holds for every unit in it): ``memory.max`` (cgroup
    v2; "max" is no limit) or ``memory.limit_in_bytes`` (v1). Also the
    files at the root of the mount: in a container with its own cgroup
    namespace, those are its own cgroup's."""
    files = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "ID:CONTROLLERS:PATH"; v2's line is "0::PATH"
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2]
        if controllers == "":
            mount, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = Path(path).parts[1:]
        if ".." in parts:
            continue
        for depth in range(len(parts), 0, -1):
            files.append(mount.joinpath(*parts[:depth], name))
    limits = [n for n in map(_number, files) if n is not None]
    return min(limits, default=None)


def _number(path: Path) -> int | None:
    """The file's content as a number; None if it holds another word ("max") or cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
