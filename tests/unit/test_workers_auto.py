"""``workers = "auto"`` (issue 27, item 3): the rule on given figures, the
figures read from /proc and cgroup files (real files, in a temporary tree),
and the setting from TOML, the environment and flags, bad values refused by
name. A real daemon with it: tests/http/test_workers_auto.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import GiB, MiB
from kvstore.errors import ConfigError
from kvstore.server_config import load
from kvstore.workers import (
    MAX_WORKERS,
    WORKER_BASE_BYTES,
    AutoWorkers,
    auto_workers,
    available_memory,
    cgroup_memory_limit,
    mem_available,
    memory_per_worker,
)

PER_WORKER = 1 * GiB + 256 * MiB  # the defaults' budget


# --- the rule ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "memory", "count", "allows"),
    [
        (1, 64 * GiB, 1, 51),  # one CPU: one worker, however much memory
        (2, 64 * GiB, 2, 51),  # CI's machine
        (64, 100 * GiB, 64, 80),
        (64, 40 * GiB, 32, 32),  # memory bounds it below the CPUs
        (256, 1024 * GiB, MAX_WORKERS, 819),  # at most 64
        (8, 3 * GiB, 2, 2),  # small memory
        (8, 512 * MiB, 1, 0),  # less than one worker's budget: still one
        (8, 0, 1, 0),
        (4, None, 4, None),  # memory unknown (no /proc): the CPUs alone
    ],
)
def test_one_worker_per_cpu_bounded_by_memory(cpus: int, memory: int | None, count: int, allows: int | None) -> None:
    assert auto_workers(cpus, memory, PER_WORKER) == AutoWorkers(count, cpus, allows)


def test_the_start_up_line() -> None:
    assert str(auto_workers(8, 3 * GiB, PER_WORKER)) == "workers = auto: 2 (cpus 8, memory allows 2)"
    assert str(auto_workers(4, None, PER_WORKER)) == "workers = auto: 4 (cpus 4, memory allows unknown)"


def test_a_workers_budget_is_its_request_bodies_and_a_base() -> None:
    assert memory_per_worker(load(None, env={})) == PER_WORKER
    small = load(None, env={"KVSTORE_MAX_BUFFERED_BODY_BYTES": "256MiB"})
    assert memory_per_worker(small) == 256 * MiB + WORKER_BASE_BYTES


# --- the machine's figures, from files -------------------------------------------------


def test_mem_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   24000000 kB\n")
    assert mem_available(meminfo) == 24_000_000 * 1024
    meminfo.write_text("MemTotal:       32768000 kB\n")  # kernels before 3.14
    assert mem_available(meminfo) is None
    assert mem_available(tmp_path / "absent") is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v2_limit_of_the_unit_or_its_slice(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self-cgroup"
    _write(self_cgroup, "0::/system.slice/kvstore.service")
    _write(root / "system.slice" / "kvstore.service" / "memory.max", "max")
    assert cgroup_memory_limit(self_cgroup, root) is None  # "max": no limit
    _write(root / "system.slice" / "memory.max", str(8 * GiB))
    assert cgroup_memory_limit(self_cgroup, root) == 8 * GiB  # the slice's holds for the unit
    _write(root / "system.slice" / "kvstore.service" / "memory.max", str(2 * GiB))  # MemoryMax=2G
    assert cgroup_memory_limit(self_cgroup, root) == 2 * GiB


def test_cgroup_limit_in_a_container(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self-cgroup"
    _write(self_cgroup, "0::/")  # its own cgroup namespace: the mount's root is its cgroup
    _write(root / "memory.max", str(4 * GiB))
    assert cgroup_memory_limit(self_cgroup, root) == 4 * GiB


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self-cgroup"
    _write(self_cgroup, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    _write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", str(3 * GiB))
    assert cgroup_memory_limit(self_cgroup, root) == 3 * GiB


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path / "absent", tmp_path) is None


def test_available_memory_is_the_lower_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemAvailable:   8388608 kB")  # 8 GiB
    _write(proc / "self" / "cgroup", "0::/")
    assert available_memory(proc, root) == 8 * GiB
    _write(root / "memory.max", str(3 * GiB))
    assert available_memory(proc, root) == 3 * GiB
    _write(root / "memory.max", str(16 * GiB))
    assert available_memory(proc, root) == 8 * GiB
    assert available_memory(tmp_path / "no-proc", tmp_path / "no-cgroup") is None


# --- the setting ------------------------------------------------------------------------


def test_auto_is_the_default() -> None:
    cfg = load(None, env={})
    assert cfg.workers == "auto"
    with pytest.raises(RuntimeError, match="not resolved"):
        _ = cfg.worker_count  # server.py resolves it before anything counts processes


@pytest.mark.parametrize(("toml", "expected"), [('"auto"', "auto"), ("1", 1), ("4", 4)])
def test_from_toml(tmp_path: Path, toml: str, expected: int | str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(f"workers = {toml}\n")
    assert load(path, env={}).workers == expected


def test_from_the_environment_and_flags() -> None:
    assert load(None, env={"KVSTORE_WORKERS": "auto"}).workers == "auto"
    assert load(None, env={"KVSTORE_WORKERS": "1"}).worker_count == 1
    assert load(None, env={"KVSTORE_WORKERS": "1"}, flags={"workers": "auto"}).workers == "auto"
    assert load(None, env={"KVSTORE_WORKERS": "auto"}, flags={"workers": "3"}).worker_count == 3


@pytest.mark.parametrize("toml", ["0", "-1", '"many"', "1.5", "true", '"1.5"', '"AUTO"', '""'])
def test_bad_values_in_toml_name_the_key(tmp_path: Path, toml: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(f"workers = {toml}\n")
    with pytest.raises(ConfigError) as e:
        load(path, env={})
    assert str(e.value).startswith("workers=") and "expected a positive integer or 'auto'" in str(e.value)


@pytest.mark.parametrize("value", ["0", "-1", "many", "1.5", "true", ""])
def test_bad_values_from_the_environment_and_flags_name_them(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(None, env={"KVSTORE_WORKERS": value})
    assert str(e.value) == f"KVSTORE_WORKERS={value!r}: expected a positive integer or 'auto'"
    with pytest.raises(ConfigError) as e:
        load(None, env={}, flags={"workers": value})
    assert str(e.value) == f"--workers={value!r}: expected a positive integer or 'auto'"
