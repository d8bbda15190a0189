"""``workers = "auto"``, the default (issue 27, item 3), on a real daemon:
one worker per CPU this process may run on, bounded by memory, logged once
at start-up; on one CPU, or with ``KVSTORE_WORKERS=1``, one process and no
supervisor; a bad count stops start-up naming the setting. The rule itself:
tests/unit/test_workers_auto.py."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvstore.workers import MAX_WORKERS, cpu_count

from .conftest import ROOT, Daemon
from .test_metrics_workers import _value

AUTO_LINE = re.compile(r"workers = auto: (\d+) \(cpus (\d+), memory allows (\d+|unknown)\)")


async def _answering(daemon: Daemon, session: aiohttp.ClientSession, count: int) -> dict[int, str]:
    """pid -> role of the processes that answer /healthz over fresh
    connections (the kernel spreads them over the workers): at least 20
    requests, and more until ``count`` processes answered (for 30 s at most)."""
    seen: dict[int, str] = {}
    asked = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while (len(seen) < count or asked < 20) and loop.time() < deadline:
        async with session.get(f"{daemon.base}/healthz") as r:
            doc = await r.json()
        seen[doc["pid"]] = doc["role"]
        asked += 1
    return seen


async def _metric_workers(daemon: Daemon, session: aiohttp.ClientSession, count: int) -> float:
    """``kvstore_workers`` of /metrics, once it covers ``count`` workers (each
    snapshots every 0.5 s) or a few seconds went by."""
    value = 0.0
    for _ in range(40):
        async with session.get(f"{daemon.base}/metrics") as r:
            value = _value(await r.text(), "kvstore_workers")
        if value == count:
            break
        await asyncio.sleep(0.25)
    return value


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _auto_line(daemon: Daemon) -> tuple[int, int, str]:
    lines = AUTO_LINE.findall(daemon.log.read_text())
    assert len(lines) == 1, "logged once, by the supervisor, before it forks"
    count, cpus, allows = lines[0]
    return int(count), int(cpus), allows


async def test_auto_starts_one_worker_per_cpu(daemon: Daemon) -> None:
    daemon.extra = ["--workers", "auto"]  # beats KVSTORE_WORKERS=1 of the test environment
    daemon.start()
    assert daemon.proc is not None
    count, cpus, allows = _auto_line(daemon)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        answering = await _answering(daemon, s, count)
        assert cpus == cpu_count() == len(os.sched_getaffinity(0))
        assert count == max(1, min(cpus, MAX_WORKERS, int(allows) if allows != "unknown" else cpus))
        assert len(answering) == count
        if count == 1:  # a small machine: a single process
            assert answering == {daemon.proc.pid: "single"}
        else:  # 2 on CI: the supervisor's workers answer, not the supervisor
            assert daemon.proc.pid not in answering and sorted(_children(daemon.proc.pid)) == sorted(answering)
            assert sorted(answering.values()) == ["reader"] * (count - 1) + ["writer"]
        assert await _metric_workers(daemon, s, count) == count
    assert daemon.stop() == 0
    if count > 1:
        assert f"with {count} workers" in daemon.output


async def _one_process(daemon: Daemon) -> None:
    assert daemon.proc is not None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        assert await _answering(daemon, s, 1) == {daemon.proc.pid: "single"}
        assert await _metric_workers(daemon, s, 1) == 1
    assert _children(daemon.proc.pid) == []
    assert daemon.stop() == 0


@pytest.mark.parametrize("source", ["default", "KVSTORE_WORKERS=auto"])
async def test_auto_on_one_cpu_is_a_single_process(daemon: Daemon, source: str) -> None:
    del daemon.env["KVSTORE_WORKERS"]  # the test environment's 1: the daemon's default instead
    if source != "default":
        daemon.env["KVSTORE_WORKERS"] = "auto"
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})  # the daemon inherits the mask: one CPU
    try:
        daemon.start()
    finally:
        os.sched_setaffinity(0, mask)
    assert _auto_line(daemon)[:2] == (1, 1)
    await _one_process(daemon)


async def test_workers_1_is_one_process_without_a_supervisor(daemon: Daemon) -> None:
    daemon.env["KVSTORE_WORKERS"] = "1"
    daemon.start()
    await _one_process(daemon)
    assert "workers = auto" not in daemon.output


@pytest.mark.parametrize(
    ("args", "env", "toml", "needle"),
    [
        (["--workers", "0"], {}, None, "--workers='0': expected a positive integer or 'auto'"),
        (["--workers", "many"], {}, None, "--workers='many': expected a positive integer or 'auto'"),
        ([], {"KVSTORE_WORKERS": "-1"}, None, "KVSTORE_WORKERS='-1': expected a positive integer or 'auto'"),
        ([], {"KVSTORE_WORKERS": "1.5"}, None, "KVSTORE_WORKERS='1.5': expected a positive integer or 'auto'"),
        ([], {}, "workers = 1.5", "workers=1.5: expected a positive integer or 'auto'"),
        ([], {}, "workers = true", "workers=True: expected a positive integer or 'auto'"),
    ],
)
def test_a_bad_count_stops_startup(
    daemon: Daemon, tmp_path: Path, args: list[str], env: dict[str, str], toml: str | None, needle: str
) -> None:
    if toml is not None:
        (tmp_path / "kvstore.toml").write_text(toml + "\n")
        args = [*args, "--config", str(tmp_path / "kvstore.toml")]
    base = {k: v for k, v in daemon.env.items() if k != "KVSTORE_WORKERS"}  # the test's 1 would beat the file
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(daemon.data_dir), *args]
    out = subprocess.run(cmd, env=base | env, capture_output=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.decode().strip() == f"kvstore: {needle}"
    assert not daemon.data_dir.exists()
