"""Open segment files, shared by every read, and dropped safely.

A read takes a segment with :meth:`SegmentCache.acquire` and gives it back
with ``release()``. Dropping a segment (eviction, tenant deletion) takes it
out of the cache and unlinks the file under the cache's lock, so no read can
reopen it in between; the descriptor is closed when the last read in
progress releases it, never under a read.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from kvstore.engine import verified
from kvstore.engine.segment import SegmentFile, segment_name

SegmentKey = tuple[str, int]


class SegmentCache:
    def __init__(self, seg_root: Path) -> None:
        self._root = seg_root
        self._segs: dict[SegmentKey, SegmentFile] = {}
        self._lock = threading.Lock()

    def path(self, tenant: str, segment_id: int) -> Path:
        return self._root / tenant / segment_name(segment_id)

    def register(self, seg: SegmentFile) -> None:
        with self._lock:
            self._segs[(seg.header.tenant, seg.segment_id)] = seg

    def acquire_cached(self, key: SegmentKey) -> SegmentFile | None:
        """The segment if it is open already (no I/O: safe on the event loop)."""
        seg = self._segs.get(key)
        return seg if seg is not None and seg.acquire() else None

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
            return seg

    def segment_keys(self) -> list[SegmentKey]:
        with self._lock:
            return list(self._segs)

    def forget(self, key: SegmentKey, unlink: bool = False) -> None:
        """Stop serving the segment from here (closing it after the reads in
        progress); ``unlink`` also removes the file."""
        with self._lock:
            seg = self._segs.pop(key, None)
            if seg is not None:
                seg.retire()
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    self.path(*key).unlink()

    def forget_tenant(self, tenant: str) -> None:
        with self._lock:
            for key in [k for k in self._segs if k[0] == tenant]:
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
