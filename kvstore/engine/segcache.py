"""Open segment files, shared by every read, and dropped safely.

A read takes a segment with :meth:`SegmentCache.acquire` and gives it back
with ``release()``. Dropping a segment (eviction, tenant deletion) takes it
out of the cache and unlinks the file under the cache's lock, so no read can
reopen it in between; the descriptor is closed when the last read in
progress releases it, never under a read.

The files the cache opens itself (for reads) are bounded: past
``max_open`` of them, the eighth least recently acquired are closed (after
the reads in progress, as a drop does) and reopened when next read. The
segments the writer registers (those it appends to) are its own and never
closed here. The open files of a process are thus about ``max_open`` (the
``max_open_segments`` setting), plus two per tenant with an open segment
on the writer, whatever the count of segments.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from pathlib import Path

from kvstore.engine import verified
from kvstore.engine.segment import SegmentFile, segment_name

SegmentKey = tuple[str, int]


DEFAULT_MAX_OPEN = 4096


class SegmentCache:
    def __init__(self, seg_root: Path, max_open: int = DEFAULT_MAX_OPEN) -> None:
        self._root = seg_root
        self._segs: dict[SegmentKey, SegmentFile] = {}
        self._lock = threading.Lock()
        self._max_open = max_open
        # The files opened here for reads, by when each was last acquired
        # (a tick, written without the lock: a plain dict store).
        self._opened: dict[SegmentKey, int] = {}
        self._tick = itertools.count()

    @property
    def opened(self) -> int:
        """Files this cache opened for reads and holds now."""
        return len(self._opened)

    def path(self, tenant: str, segment_id: int) -> Path:
        return self._root / tenant / segment_name(segment_id)

    def register(self, seg: SegmentFile) -> None:
        with self._lock:
            key = (seg.header.tenant, seg.segment_id)
            self._opened.pop(key, None)
            self._segs[key] = seg

    def acquire_cached(self, key: SegmentKey) -> SegmentFile | None:
        """The segment if it is open already (no I/O: safe on the event loop)."""
        seg = self._segs.get(key)
        if seg is None or not seg.acquire():
            return None
        if key in self._opened:
            self._opened[key] = next(self._tick)
        return seg

    def acquire(self, key: SegmentKey) -> SegmentFile | None:
        """The segment, opened if needed (blocking), or None when there is no
        local file. The caller must ``release()`` it."""
        seg = self.acquire_cached(key)
        if seg is not None:
            return seg
        with self._lock:
            seg = self._segs.get(key)
            if seg is None or not seg.acquire():
                try:
                    seg = SegmentFile.open(self.path(*key), writable=False)
                except FileNotFoundError:
                    return None
                self._segs[key] = seg
                seg.acquire()
                self._hold_for_reads(key)
            return seg

    def _hold_for_reads(self, key: SegmentKey) -> None:
        """Count ``key`` among the files held for reads, closing the least
        used past the bound; under the lock."""
        self._opened[key] = next(self._tick)
        if len(self._opened) > self._max_open:
            self._close_least_used()

    def _close_least_used(self) -> None:
        """Close (once their reads end) the eighth of the files opened for
        reads that were acquired longest ago; under the lock."""
        ticks = sorted(self._opened.items(), key=lambda kv: kv[1])
        for key, _ in ticks[: max(1, len(ticks) // 8)]:
            del self._opened[key]
            seg = self._segs.pop(key, None)
            if seg is not None:
                seg.retire()

    def sealed(self, key: SegmentKey) -> None:
        """The writer sealed a segment it registered: from now on it is one of
        the files held for reads (closed past the bound, reopened read-only
        when next read). Thread-safe (an appender's thread calls it)."""
        with self._lock:
            if key in self._segs:
                self._hold_for_reads(key)

    def segment_keys(self) -> list[SegmentKey]:
        with self._lock:
            return list(self._segs)

    def forget(self, key: SegmentKey, unlink: bool = False) -> None:
        """Stop serving the segment from here (closing it after the reads in
        progress); ``unlink`` also removes the file."""
        with self._lock:
            self._opened.pop(key, None)
            seg = self._segs.pop(key, None)
            if seg is not None:
                seg.retire()
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    self.path(*key).unlink()

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            for key in [k for k in self._segs if k[0] == tenant]:
                self._opened.pop(key, None)
                self._segs.pop(key).retire()

    def forget_verified(self, names: set[str] | None = None) -> None:
        """Drop the verified-frames cache (verified.py) of the open segments
        named (``tenant/file.seg``), or of all of them."""
        with self._lock:
            segs = list(self._segs.values())
        for seg in segs:
            if names is None or seg.name in names:
                verified.forget(seg)

    def close(self) -> None:
        with self._lock:
            for seg in self._segs.values():
                seg.retire()
            self._segs.clear()
