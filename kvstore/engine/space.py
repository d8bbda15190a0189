"""Local space: how full the data directory is, and which segments to drop first.

Usage is measured one of two ways:
- ``capacity`` set: the bytes of the segment files under the data directory
  (rescanned at each eviction pass, plus what was written since), against it;
- ``capacity`` 0: the data directory's filesystem as ``statvfs`` reports it
  (used = size - available to this user), against its size.

Above ``high_watermark`` percent, droppable segments are dropped until usage
is at or below ``low_watermark`` percent: first local copies of segments the
object tier holds (nothing is lost), then sealed segments of ephemeral tenants
(their blocks become misses), each group least recently read first. A write
that would take usage past 100% with nothing left to drop is refused (507).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SegmentKey = tuple[str, int]  # (tenant, segment id)


@dataclass(frozen=True, slots=True)
class Usage:
    used: int
    capacity: int

    def percent(self, extra: int = 0) -> float:
        return 100.0 * (self.used + extra) / self.capacity if self.capacity else 100.0


@dataclass(frozen=True, slots=True)
class Candidate:
    key: SegmentKey
    size: int
    mirrored: bool  # True: dropping the local copy loses nothing
    incarnation: int = 0  # the tenant's, when chosen: a tenant created again has other segments


class Space:
    def __init__(self, root: Path, seg_root: Path, capacity: int, high: int, low: int) -> None:
        self._root = root
        self._seg_root = seg_root
        self.capacity = capacity
        self.high = high
        self.low = low
        self._lock = threading.Lock()
        self._scanned = 0
        self._since_scan = 0
        self._last_read: dict[SegmentKey, float] = {}
        self.local = (0, 0)  # segment files and their bytes, as of the last rescan

    # -- measurement ----------------------------------------------------------

    def rescan(self) -> Usage:
        """Measure from scratch (file sizes or statvfs); runs on a thread. Also
        remembers how many segment files are local, and their bytes (``local``)."""
        files = segment_files(self._seg_root, suffix="")
        segs = [size for path, size in files if path.endswith(".seg")]
        self.local = (len(segs), sum(segs))
        if self.capacity:
            total = sum(size for _, size in files)
            with self._lock:
                self._scanned, self._since_scan = total, 0
        return self.usage()

    def usage(self) -> Usage:
        if not self.capacity:
            st = os.statvfs(self._root)
            size = st.f_blocks * st.f_frsize
            return Usage(size - st.f_bavail * st.f_frsize, size)
        with self._lock:
            return Usage(self._scanned + self._since_scan, self.capacity)

    def wrote(self, nbytes: int) -> None:
        """Bytes just added under the data directory (counted until the next rescan)."""
        with self._lock:
            self._since_scan += nbytes

    def removed(self, nbytes: int) -> None:
        with self._lock:
            self._since_scan -= nbytes

    def over_high(self, extra: int = 0) -> bool:
        return self.usage().percent(extra) > self.high

    def fits(self, nbytes: int) -> bool:
        u = self.usage()
        return u.used + nbytes <= u.capacity

    # -- recency --------------------------------------------------------------

    def touch(self, key: SegmentKey) -> None:
        self._last_read[key] = time.monotonic()

    def forget(self, key: SegmentKey) -> None:
        self._last_read.pop(key, None)

    def victims(self, candidates: list[Candidate], usage: Usage) -> list[Candidate]:
        """The candidates to drop, in order, to bring ``usage`` down to the low
        watermark: mirrored copies first, then ephemeral segments; each group
        least recently read first (never read since start: oldest id first)."""
        target = usage.capacity * self.low / 100
        order = sorted(candidates, key=lambda c: (not c.mirrored, self._last_read.get(c.key, 0.0), c.key[1]))
        out: list[Candidate] = []
        used = usage.used
        for c in order:
            if used <= target:
                break
            out.append(c)
            used -= c.size
        return out


def segment_files(seg_root: Path, suffix: str = ".seg") -> list[tuple[str, int]]:
    """(path, size) of the files under ``seg_root``/TENANT/ whose names end with
    ``suffix``. Files and directories may come and go meanwhile (segments being
    created under ``.tmp`` names, dropped, or a tenant deleted): those are skipped."""
    out: list[tuple[str, int]] = []
    try:
        tenants = list(os.scandir(seg_root))
    except FileNotFoundError:
        return out
    for tenant_dir in tenants:
        try:
            if not tenant_dir.is_dir():
                continue
            entries = list(os.scandir(tenant_dir.path))
        except FileNotFoundError:
            continue
        for f in entries:
            if f.name.endswith(suffix):
                try:
                    out.append((f.path, f.stat().st_size))
                except FileNotFoundError:
                    continue
    return out
