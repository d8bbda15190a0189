"""The plumbing every benchmark shares, defined once: free ports of 127.0.0.1,
percentiles, CPU seconds (of this process, of a pid, of a process tree, of a
process group), a process's children, the processes a run starts (each in a group of its own, and
stopped with it), and a plain keep-alive HTTP/1.1 connection.

The kvstore daemon itself is started by bench/daemon.py, on top of this.
CPU figures come from /proc (Linux), as the daemons they measure run there."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import resource
import signal
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- ports ----------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(n: int, offset: int = 0) -> list[int]:
    """``n`` distinct free TCP ports of 127.0.0.1, all held until every one is
    found, so that no two are the same. With ``offset``, only ports ``p`` whose
    ``p + offset`` is free too (SeaweedFS derives a gRPC port as HTTP port +
    10000); those are held as well."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(200 * n):
            if len(ports) == n:
                break
            a = socket.socket()
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            pair: list[socket.socket] = [a]
            if offset:
                b = socket.socket()
                pair.append(b)
                try:
                    if port + offset > 65535:
                        raise OSError("out of range")
                    b.bind(("127.0.0.1", port + offset))
                except OSError:
                    for s in pair:
                        s.close()
                    continue
            held += pair
            ports.append(port)
        if len(ports) < n:
            raise RuntimeError(f"found {len(ports)} of {n} free ports of 127.0.0.1 (offset {offset})")
        return ports
    finally:
        for s in held:
            s.close()


# -- percentiles ------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of ``values``: the smallest
    value with at least a fraction ``q`` of the values at or below it, always one
    of the values (never interpolated); q = 0 gives the smallest. NaN when there
    are none. The benchmarks' p50 and p99 all come from here."""
    if not 0 <= q <= 1:
        raise ValueError(f"percentile: q={q!r}: expected a fraction from 0 to 1 (0.99, not 99)")
    s = sorted(values)
    if not s:
        return float("nan")
    rank = math.ceil(q * len(s) - 1e-9)  # -1e-9: 0.07 * 100 is 7.000000000000001 in binary floating point
    return s[min(len(s), max(1, rank)) - 1]


def percentile_or_none(values: Sequence[float], q: float) -> float | None:
    """:func:`percentile`, but None (JSON's null) when there are no values: for
    documents that must stay JSON (run's and replay's), where NaN is not."""
    return percentile(values, q) if values else None


# -- CPU time ---------------------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process, all its threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces):
    [1] ppid, [2] pgrp, [11] utime, [12] stime, [13] cutime, [14] cstime."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def pid_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` alone, all its threads;
    not its children."""
    f = _stat(pid)
    return (int(f[11]) + int(f[12])) / CLK_TCK


def _all_stats() -> dict[int, list[str]]:
    """:func:`_stat` of every live process (those that end meanwhile left out)."""
    stats: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = _stat(entry.name)
            except OSError:
                continue
    return stats


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live descendants."""
    stats = _all_stats()
    children: dict[int, list[int]] = {}
    for p, f in stats.items():
        children.setdefault(int(f[1]), []).append(p)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        st = stats.get(p)
        if st is not None:
            total += int(st[11]) + int(st[12])
        todo.extend(children.get(p, []))
    return total / CLK_TCK


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid``, oldest first (by start time: a supervisor's
    first-forked worker first)."""
    kids = [(int(f[19]), p) for p, f in _all_stats().items() if len(f) > 19 and int(f[1]) == pid]
    return [p for _, p in sorted(kids)]


def group_pids(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (from /proc)."""
    return [p for p, f in _all_stats().items() if len(f) > 2 and int(f[2]) == pgid]


def group_cpu_seconds(pgid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the live processes of a group, each with the
    children it has reaped."""
    user = system = 0
    for pid in group_pids(pgid):
        try:
            f = _stat(pid)
        except OSError:
            continue
        user += int(f[11]) + int(f[13])  # utime + cutime
        system += int(f[12]) + int(f[14])  # stime + cstime
    return user / CLK_TCK, system / CLK_TCK


# -- processes ----------------------------------------------------------------------


class Processes:
    """Every process this run starts, each the leader of its own process group
    (``start_new_session``), so that stopping one stops its workers too."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, cmd: Sequence[str], log: Path | None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        out: Any = subprocess.PIPE
        with contextlib.ExitStack() as stack:
            if log is not None:  # a file, not a pipe: a full pipe would stall a server
                out = stack.enter_context(log.open("ab"))
            proc = subprocess.Popen(
                list(cmd),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        if group_pids(pgid):  # never signal a group id that nothing of ours holds any more
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def stop(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal the leader (a server stops its own workers, in its own order), wait
        for it (SIGKILL the whole group on a timeout), then SIGKILL anything left
        in its group."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self._signal_group(proc.pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()
        with contextlib.suppress(ValueError):
            self._procs.remove(proc)
        return proc.returncode

    def stop_all(self) -> None:
        for proc in reversed(list(self._procs)):
            with contextlib.suppress(Exception):
                self.stop(proc, signal.SIGTERM, timeout=10)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (and SIGHUP) unwind like Ctrl-C, so that the finally blocks stop the servers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# -- HTTP -------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """A keep-alive HTTP/1.1 connection to 127.0.0.1 (one per thread)."""

    def __init__(self, port: int, token: str = "") -> None:
        self.port = port
        self.token = token
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Reply:
        h = dict(headers or {})
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        for attempt in range(2):
            try:
                self._conn.request(method, path, body=body, headers=h)
                r = self._conn.getresponse()
                return Reply(r.status, r.read(), {k.lower(): v for k, v in r.getheaders()})
            except (ConnectionError, http.client.HTTPException):
                self._conn.close()  # a server may close an idle keep-alive connection; retry once
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._conn.close()
