"""bench/harness.py, what every benchmark measures with: its percentile
convention, free ports, CPU seconds, and process groups stopped whole.

Regressions pinned here: the benchmarks had five percentile helpers that
disagreed. compaction, nixl, events, s3 and tier took the value at index
int(q * n), so the p99 of 100 latencies was the largest of them and the p50 of
an even count the upper middle one; hostile interpolated (statistics.quantiles)
and reported 0.0 for a single request; run's returned None and qos's NaN for
no values. One nearest-rank definition now serves them all."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvstore_bench.harness import (
    Processes,
    cpu_seconds,
    free_port,
    free_ports,
    group_cpu_seconds,
    group_pids,
    percentile,
    percentile_or_none,
    pid_cpu_seconds,
    tree_cpu_seconds,
)


def test_percentile_is_nearest_rank_never_interpolated() -> None:
    xs = [float(i) for i in range(100, 0, -1)]  # 1..100, unsorted
    assert percentile(xs, 0.5) == 50.0  # int(q * n) took the 51st
    assert percentile(xs, 0.99) == 99.0  # int(q * n) took the largest
    assert percentile(xs, 1.0) == 100.0
    assert percentile(xs, 0.0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0  # the lower middle, not 2.5
    assert percentile([7.0], 0.99) == 7.0  # hostile's quantiles reported 0.0 here
    assert xs[0] == 100.0  # the caller's list is left as it was


def test_percentile_rank_is_not_moved_by_binary_floating_point() -> None:
    """0.07 * 100 is 7.000000000000001: a plain ceil would take the 8th value."""
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.07) == 7.0
    assert percentile(range(1, 201), 0.14) == 28


def test_percentile_of_nothing_is_nan_or_none_for_json() -> None:
    assert math.isnan(percentile([], 0.5))
    assert percentile_or_none([], 0.99) is None
    assert percentile_or_none([3.0, 1.0, 2.0], 0.5) == 2.0


@pytest.mark.parametrize("q", [-0.1, 1.5, 50, 99])
def test_percentile_refuses_a_q_that_is_not_a_fraction(q: float) -> None:
    with pytest.raises(ValueError, match="fraction from 0 to 1"):
        percentile([1.0, 2.0], q)


def test_a_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_ports_are_distinct_and_their_offset_ports_are_free() -> None:
    ports = free_ports(4, offset=10000)
    assert len(set(ports)) == 4
    held = []
    try:
        for p in ports:
            for q in (p, p + 10000):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", q))
    finally:
        for s in held:
            s.close()


def _spin(cpu: float) -> None:
    """Use ``cpu`` CPU seconds of this process (10 s of wall time at most)."""
    c0, deadline = cpu_seconds(), time.monotonic() + 10
    while cpu_seconds() - c0 < cpu and time.monotonic() < deadline:
        sum(range(10_000))


def test_cpu_seconds_are_monotone_and_agree_with_proc() -> None:
    c0, p0, t0 = cpu_seconds(), pid_cpu_seconds(os.getpid()), tree_cpu_seconds(os.getpid())
    _spin(0.2)
    c1, p1, t1 = cpu_seconds(), pid_cpu_seconds(os.getpid()), tree_cpu_seconds(os.getpid())
    assert c1 - c0 >= 0.2
    assert p1 >= p0 and t1 >= t0
    assert abs((p1 - p0) - (c1 - c0)) < 0.1  # /proc counts in clock ticks (10 ms)
    assert t1 >= p1 - 0.02  # the tree holds the process itself


def test_a_process_group_is_measured_and_stopped_whole(tmp_path: Path) -> None:
    """A leader that ignores SIGTERM, with a busy child: stop() waits, then kills both."""
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    procs = Processes()
    log = tmp_path / "log"
    proc = procs.spawn([sys.executable, "-c", code], log)
    try:
        deadline = time.monotonic() + 30
        while (len(group_pids(proc.pid)) < 2 or "up" not in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(group_pids(proc.pid)) == 2
        user0, _ = group_cpu_seconds(proc.pid)
        while group_cpu_seconds(proc.pid)[0] - user0 < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_cpu_seconds(proc.pid)[0] > user0
    finally:
        rc = procs.stop(proc, signal.SIGTERM, timeout=0.5)
    assert rc == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _live(group_pids(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live(group_pids(proc.pid)) == []


def _live(pids: list[int]) -> list[int]:
    """``pids`` but the zombies (an orphan is reaped by whatever init this container has, if any)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def test_harness_imports_nothing_of_the_daemon() -> None:
    """Plumbing only: the benchmarks that run the engine in-process import it too."""
    code = "import sys, kvstore_bench.harness; print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvstore'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
