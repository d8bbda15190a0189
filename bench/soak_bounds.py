"""kvstore-bench soak's bounds: what a soak's samples must show for ``--check``.

Pure functions over the series (no daemon, no I/O): tests/bench/test_soak_bounds.py
runs them on series made by hand.

The samples after the warm-up (the first :data:`WARMUP_FRACTION` of the run
or :data:`WARMUP_MAX_S`, whichever is shorter: the daemon's pools, caches
and thread pools fill then, and the operator's churn has run once) are
split in thirds:

* **anonymous RSS** of each worker (``RssAnon``: heap, buffers, the
  decoded-blocks cache; not the segment files' or LMDB's mapped pages,
  which are file-backed, shared with the page cache, and grow with the data,
  not with a leak): the largest value of the last third may exceed the
  median of the first third by at most :data:`RSS_ANON_GROWTH` bytes;
* **open descriptors** and **threads** of each worker: the largest and the
  smallest value after the warm-up differ by at most :data:`FDS_SPREAD_FILES`
  plus the soak's client connections (``--clients``: 24 by default), and
  :data:`THREADS_SPREAD` (plus :data:`S3_POOL_THREADS` with an object tier);
* each worker is the **same process** throughout (a worker that died and
  was replaced would reset its figures);
* **0 errors** and **0 wrong bytes**.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MiB = 1 << 20
WARMUP_FRACTION = 0.2
WARMUP_MAX_S = 60.0
# Anonymous memory may move by this much with no leak: a sample taken mid-burst holds up to
# a request body per client in flight (8 of at most 1 MiB, in aligned buffers the writer's
# group commit batches); glibc's arenas (one per thread that allocates) keep some of what a
# burst freed and give it back in their own time. Measured on the soak's load (2 workers,
# 5 minutes, three runs): a reader moved 0.0-0.2 MiB after the warm-up; the writer 4-7 MiB,
# levelling off at about 117 MiB after 3-4 minutes (as much with glibc's mmap threshold
# fixed). A leak of 1 KiB a request passes 5 minutes at 50 requests a second (15 MiB) and
# breaks 60 (176 MiB).
RSS_ANON_GROWTH = 16 * MiB
# Descriptors: the soak's clients hold at most --clients keep-alive connections, which land
# on either worker and are closed when idle and opened again, so a worker's count moves by
# up to that many; beside them by up to FDS_SPREAD_FILES: compaction opens the segments it
# copies, a flush seals each tenant's open segment and opens the next, a reader relays
# writes to the writer on a connection or two. None of it grows.
FDS_SPREAD_FILES = 16
DEFAULT_CLIENTS = 8  # kvstore-bench soak's --clients
# Threads: the executors start threads as work comes and keep them; a flush, a compaction
# and an upload each take one while they run.
THREADS_SPREAD = 4
# With an object tier, the S3 tier's pool (kvstore/tier/s3.py: 16 threads) starts a thread
# whenever a task finds none idle, up to 16: a burst of uploads or deletes after the warm-up
# larger than any before it adds threads, never past the pool's size.
S3_POOL_THREADS = 16


@dataclass(frozen=True, slots=True)
class Limits:
    """The tolerances of the bounds (the module's constants by default)."""

    rss_anon_growth: int = RSS_ANON_GROWTH
    fds_spread: int = FDS_SPREAD_FILES + DEFAULT_CLIENTS
    threads_spread: int = THREADS_SPREAD

    @classmethod
    def for_run(cls, clients: int, object_tier: bool = False) -> Limits:
        """The limits of a soak whose load holds up to ``clients`` connections,
        on a daemon with or without an object tier."""
        threads = THREADS_SPREAD + (S3_POOL_THREADS if object_tier else 0)
        return cls(fds_spread=FDS_SPREAD_FILES + clients, threads_spread=threads)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One bound on one subject (a worker, or the run): the value measured
    (None: not measured, so not judged), its limit, and whether it holds."""

    bound: str
    subject: str
    value: float | None
    limit: float
    ok: bool

    def line(self) -> str:
        if self.value is None:
            return f"{self.bound} {self.subject}: not measured"
        unit, scale = (" MiB", MiB) if self.bound == "rss_anon_growth" else ("", 1)
        sign = "<=" if self.ok else ">"
        return f"{self.bound} {self.subject}: {self.value / scale:.1f}{unit} {sign} {self.limit / scale:g}{unit}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Series = Sequence[tuple[float, float]]  # (seconds since the start, value)


def warmup_s(duration_s: float) -> float:
    """The warm-up of a run of ``duration_s``: its first fifth, at most a minute."""
    return min(WARMUP_FRACTION * duration_s, WARMUP_MAX_S)


def growth(series: Series, warmup: float, end: float) -> float | None:
    """The largest value of the last third after ``warmup`` minus the median of
    the first third (None with fewer than 3 samples after the warm-up)."""
    after = [(t, v) for t, v in series if t >= warmup]
    if len(after) < 3:
        return None
    third = (end - warmup) / 3
    early = [v for t, v in after if t <= warmup + third] or [after[0][1]]
    late = [v for t, v in after if t >= end - third] or [after[-1][1]]
    return max(late) - statistics.median(early)


def spread(series: Series, warmup: float) -> float | None:
    """The largest minus the smallest value after ``warmup`` (None: no sample there)."""
    values = [v for t, v in series if t >= warmup]
    return max(values) - min(values) if values else None


def check(
    workers: Mapping[str, Mapping[str, Series]],
    errors: int,
    wrong_bytes: int,
    warmup: float,
    end: float,
    limits: Limits = Limits(),
) -> list[Verdict]:
    """Every bound over ``workers`` (role -> figure -> series; the figures
    ``rss_anon``, ``fds``, ``threads`` and ``pid``) and the run's error and
    wrong-byte counts, in that order; a bound whose series is missing is
    reported as not measured and holds."""

    def judge(bound: str, subject: str, value: float | None, limit: float) -> Verdict:
        return Verdict(bound, subject, value, limit, value is None or value <= limit)

    out = []
    for role, figures in workers.items():
        out.append(
            judge("rss_anon_growth", role, growth(figures.get("rss_anon", ()), warmup, end), limits.rss_anon_growth)
        )
        out.append(judge("fds_spread", role, spread(figures.get("fds", ()), warmup), limits.fds_spread))
        out.append(judge("threads_spread", role, spread(figures.get("threads", ()), warmup), limits.threads_spread))
        pids = {v for _, v in figures.get("pid", ())}
        out.append(judge("restarts", role, float(len(pids) - 1) if pids else None, 0))
    out.append(judge("errors", "run", float(errors), 0))
    out.append(judge("wrong_bytes", "run", float(wrong_bytes), 0))
    return out


def broken(verdicts: Sequence[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if not v.ok]
