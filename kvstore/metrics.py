"""Process-local metrics: counters and histograms, rendered as Prometheus text.

Thread-safe (the executor threads record fsync latency and batch sizes).
The thread that made the :class:`Metrics` (the event loop's, which records
most of them: every request counts several) records into series of its
own without taking the lock; every reading adds them in. With several
worker processes, each one's :meth:`Metrics.snapshot` is
merged into one exposition by :func:`merged` (see transport/http/metrics.py).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Labels = tuple[tuple[str, str], ...]

_BUCKETS: dict[str, tuple[float, ...]] = {
    "seconds": (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    "records": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    "bytes": (4096, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20),
}


# Series whose values outgrow their suffix's buckets: a takeover opens a dead
# node's segments one after the other (docs/fleet.md: 86 s for a day's at 10 ms
# a segment), past the 10 s that ends the "seconds" buckets.
_BUCKETS_BY_NAME: dict[str, tuple[float, ...]] = {
    "kvstore_fleet_takeover_seconds": (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
}


def _buckets_for(name: str) -> tuple[float, ...]:
    own = _BUCKETS_BY_NAME.get(name)
    if own is not None:
        return own
    for suffix, b in _BUCKETS.items():
        if name.endswith(suffix):
            return b
    return _BUCKETS["seconds"]


class _Histogram:
    __slots__ = ("buckets", "count", "counts", "total")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.count += 1

    def copy(self) -> _Histogram:
        out = _Histogram(self.buckets)
        out.counts, out.total, out.count = list(self.counts), self.total, self.count
        return out

    def add(self, other: _Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total
        self.count += other.count


_KEYS: dict[tuple[str, Labels], tuple[str, Labels]] = {}  # (name, labels as given) -> the series' key
_KEYS_MAX = 65536


def _key(name: str, labels: dict[str, str]) -> tuple[str, Labels]:
    """A series' key: its labels sorted by name (remembered: a request counts
    the same few series again and again)."""
    if not labels:
        return name, ()
    given = (name, tuple(labels.items()))
    key = _KEYS.get(given)
    if key is None:
        if len(_KEYS) >= _KEYS_MAX:
            _KEYS.clear()
        key = _KEYS[given] = (name, tuple(sorted(given[1])))
    return key


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, Labels], float] = defaultdict(float)
        self._gauges: dict[tuple[str, Labels], float] = {}
        self._hists: dict[tuple[str, Labels], _Histogram] = {}
        # The making thread's own counters and histograms: written by it
        # alone, without the lock; read by copying (one C-level step).
        self._owner = threading.get_ident()
        self._own_counters: dict[tuple[str, Labels], float] = {}
        self._own_hists: dict[tuple[str, Labels], _Histogram] = {}

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = _key(name, labels)
        if threading.get_ident() == self._owner:
            own = self._own_counters
            own[key] = own.get(key, 0.0) + value
            return
        with self._lock:
            self._counters[key] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._gauges[(name, tuple(sorted(labels.items())))] = value

    def unset(self, name: str, **labels: str) -> None:
        """Drop a gauge (what it measured is gone: a tenant deleted)."""
        with self._lock:
            self._gauges.pop((name, tuple(sorted(labels.items()))), None)

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = _key(name, labels)
        if threading.get_ident() == self._owner:
            own = self._own_hists
            h = own.get(key)
            if h is None:
                h = own[key] = _Histogram(_buckets_for(name))
            h.observe(value)
            return
        with self._lock:
            h = self._hists.get(key)
            if h is None:
                h = self._hists[key] = _Histogram(_buckets_for(name))
            h.observe(value)

    def _tables(
        self,
    ) -> tuple[dict[tuple[str, Labels], float], dict[tuple[str, Labels], float], dict[tuple[str, Labels], _Histogram]]:
        """Every series as it is now: the locked ones with the owner's added in (copies)."""
        own_counters = dict(self._own_counters)  # (a dict's copy is one step under the GIL)
        own_hists = dict(self._own_hists)
        with self._lock:
            counters = dict(self._counters)
            gauges = dict(self._gauges)
            hists = {k: h.copy() for k, h in self._hists.items()}
        for k, v in own_counters.items():
            counters[k] = counters.get(k, 0.0) + v
        for k, h in own_hists.items():
            into = hists.get(k)
            if into is None:
                hists[k] = h.copy()
            else:
                into.add(h)
        return counters, gauges, hists

    def snapshot(self) -> dict[str, Any]:
        """Everything recorded, as JSON-able lists (for another process to merge)."""
        counters, gauges, hists = self._tables()
        return {
            "counters": [[n, list(map(list, ls)), v] for (n, ls), v in counters.items()],
            "gauges": [[n, list(map(list, ls)), v] for (n, ls), v in gauges.items()],
            "hists": [
                [n, list(map(list, ls)), list(h.buckets), list(h.counts), h.total, h.count]
                for (n, ls), h in hists.items()
            ],
        }

    def counter(self, name: str, **labels: str) -> float:
        return self._tables()[0].get(_key(name, labels), 0.0)

    def counters(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every series of the counter ``name``: its labels and its value."""
        return [(dict(labels), v) for (n, labels), v in self._tables()[0].items() if n == name]

    def without_label(self, label: str) -> Metrics:
        """A copy whose series lack ``label``: those that differed only in it
        added up (counters, gauges and histograms alike)."""
        out = Metrics()

        def drop(labels: Labels) -> Labels:
            return tuple(kv for kv in labels if kv[0] != label)

        counters, gauges, hists = self._tables()
        for (name, labels), v in counters.items():
            out._counters[(name, drop(labels))] += v
        for (name, labels), v in gauges.items():
            key = (name, drop(labels))
            out._gauges[key] = out._gauges.get(key, 0.0) + v
        for (name, labels), h in hists.items():
            key = (name, drop(labels))
            into = out._hists.get(key)
            if into is None:
                into = out._hists[key] = _Histogram(h.buckets)
            into.add(h)
        return out

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines: list[str] = []
        counters, gauges, hists = self._tables()
        for kind, table in (("counter", counters), ("gauge", gauges)):
            seen: set[str] = set()
            for (name, labels), v in sorted(table.items()):
                if name not in seen:
                    lines.append(f"# TYPE {name} {kind}")
                    seen.add(name)
                lines.append(f"{name}{_fmt(labels)} {_num(v)}")
        seen = set()
        for (name, labels), h in sorted(hists.items()):
            if name not in seen:
                lines.append(f"# TYPE {name} histogram")
                seen.add(name)
            cum = 0
            for bound, c in zip((*h.buckets, float("inf")), h.counts, strict=True):
                cum += c
                le = "+Inf" if bound == float("inf") else _num(bound)
                lines.append(f"{name}_bucket{_fmt((*labels, ('le', le)))} {cum}")
            lines.append(f"{name}_sum{_fmt(labels)} {_num(h.total)}")
            lines.append(f"{name}_count{_fmt(labels)} {h.count}")
        return "\n".join(lines) + "\n"


def _labels(raw: Any) -> Labels:
    return tuple((str(k), str(v)) for k, v in raw)


def merged(snapshots: Sequence[dict[str, Any]], summed_gauges: frozenset[str]) -> Metrics:
    """One process's worth of metrics from several processes' snapshots:
    counters and histograms added up; a gauge in ``summed_gauges`` (one
    per process, such as requests in flight) added up, any other (the
    store's, the same whichever process reads it) taken from the first
    snapshot that has it: the writer's, when it comes first."""
    out = Metrics()
    for snap in snapshots:
        for name, labels, value in snap.get("counters", []):
            out._counters[(name, _labels(labels))] += value
        for name, labels, value in snap.get("gauges", []):
            key = (name, _labels(labels))
            if name in summed_gauges:
                out._gauges[key] = out._gauges.get(key, 0.0) + value
            else:
                out._gauges.setdefault(key, value)
        for name, labels, buckets, counts, total, count in snap.get("hists", []):
            key = (name, _labels(labels))
            h = out._hists.get(key)
            if h is None:
                h = out._hists[key] = _Histogram(tuple(buckets))
            if list(h.buckets) != list(buckets):
                continue  # another version's buckets: not comparable
            h.counts = [a + b for a, b in zip(h.counts, counts, strict=True)]
            h.total += total
            h.count += count
    return out


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _fmt(labels: Labels) -> str:
    if not labels:
        return ""
    esc = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, esc, strict=True)) + "}"
