"""The space reserve: room on the data directory's filesystem that only
removals and maintenance may use, so a full disk never wedges the store.

A log-structured store frees space by writing: a delete is a tombstone,
an eviction is a tombstone, compaction copies live records before it can
remove a segment, sealing writes a footer, and LMDB needs free pages to
commit. On a disk that puts have filled to the last byte, all of these
would fail with ENOSPC and nothing could ever be freed through the API.

So the writer keeps ``DATA/reserve``, a file of ``space_reserve`` bytes
allocated up front (``posix_fallocate``: real blocks, not a sparse file, so
another process filling the filesystem cannot take them either):

- puts are admitted only while the reserve is whole (tiering's ``admit``),
  and leave headroom for the index besides;
- a removal or maintenance write that hits ENOSPC (a tombstone, a
  compaction copy, a seal, an index commit, a registry change, recovery at
  start-up) releases a quarter of the reserve (the file is truncated: its
  blocks are free at once) and is retried; from then on the store is
  *full*: puts get ``507 storage_full``, compaction runs at once and takes
  whatever frees the most space for the least copying, and rehydration
  stops;
- once enough space is free again (the reserve plus headroom), the reserve
  is allocated again and puts resume.

The reserve survives restarts (a daemon started on a full disk finds it
there); recovery at start-up may use it as removals do.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvstore.errors import StorageFull

log = logging.getLogger("kvstore.engine.reserve")
T = TypeVar("T")
MiB = 1 << 20
RESERVE_FILE = "reserve"


def is_full(e: BaseException) -> bool:
    """Whether ``e`` says the filesystem (or the index's map) is full."""
    return isinstance(e, StorageFull) or (isinstance(e, OSError) and e.errno == errno.ENOSPC)


def auto_reserve(segment_size: int, fs_size: int) -> int:
    """The default reserve: one segment (compaction copies at most the live
    part of one segment before it frees the whole of it), at most a tenth
    of the filesystem, at least 1 MiB."""
    return max(MiB, min(segment_size, fs_size // 10))


def segment_cap(segment_size: int, fs_size: int) -> int:
    """The segment size to use on a filesystem of ``fs_size`` bytes: at most
    a sixteenth of it (at least 1 MiB), so compaction can always rewrite one
    segment within the reserve, and a small disk holds many segments."""
    return max(MiB, min(segment_size, fs_size // 16))


class SpaceReserve:
    """``DATA/reserve``: ``size`` bytes set aside (thread-safe; file calls
    block, run them on the executor)."""

    def __init__(self, path: Path, size: int, available: Callable[[], int]) -> None:
        self.path = path
        self.size = size
        self._available = available  # bytes free on the filesystem now, besides the reserve
        self._lock = threading.Lock()
        self.held = _file_size(path)
        self.releases = 0  # times it was released for a removal or maintenance
        #: called (on the releasing thread) after each release, with the bytes freed
        self.on_release: Callable[[int], None] | None = None

    def available(self) -> int:
        """Bytes free on the filesystem now, besides the reserve."""
        return self._available()

    @property
    def whole(self) -> bool:
        return self.held >= self.size

    def headroom(self) -> int:
        """Free space (besides the reserve) needed before it is allocated
        again: enough that the first puts after it do not fill the disk at once."""
        return max(MiB, self.size // 4)

    def fill(self) -> bool:
        """Allocate the reserve if it is not whole and there is room for it
        and the headroom; True when it is whole."""
        with self._lock:
            if self.held >= self.size:
                return True
            if self._available() < self.size - self.held + self.headroom():
                return False
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                log.error("cannot open the space reserve %s: %s", self.path, e.strerror)
                return False
            try:
                os.posix_fallocate(fd, 0, self.size)
                os.fsync(fd)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, self.held)  # a partial allocation would hold space for nothing
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    log.error("cannot allocate the space reserve %s: %s", self.path, e.strerror)
                return False
            finally:
                os.close(fd)
            was, self.held = self.held, self.size
        if was == 0:
            log.info("space reserve of %d bytes allocated (%s)", self.size, self.path)
        return True

    def chunk(self) -> int:
        """What one release frees: a quarter of the reserve (at least 1 MiB),
        so an emergency keeps some of it for the next one."""
        return max(MiB, self.size // 4)

    def release(self) -> int:
        """Free a chunk of the reserve for a removal or maintenance step that
        found the disk full; the bytes freed (0: nothing is left of it)."""
        with self._lock:
            if self.held == 0:
                return 0
            keep = max(0, self.held - self.chunk())
            try:
                os.truncate(self.path, keep)
            except FileNotFoundError:
                keep = 0
            except OSError as e:
                log.error("cannot release the space reserve %s: %s", self.path, e.strerror)
                return 0
            freed, self.held = self.held - keep, keep
            self.releases += 1
        log.warning(
            "the disk is full: released %d bytes of the space reserve for removals and maintenance (%d left); "
            "puts are refused (507) until compaction frees space",
            freed,
            keep,
        )
        if self.on_release is not None:
            self.on_release(freed)
        return freed

    def spending(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a removal or maintenance step, on the executor); while
        it finds the disk full, release a chunk of the reserve and run it
        again (``fn`` must leave nothing behind when it fails: an appender
        batch is cut back, an index transaction aborted)."""
        while True:
            try:
                return fn()
            except (OSError, StorageFull) as e:
                if not is_full(e) or not self.release():
                    raise


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


__all__ = ["RESERVE_FILE", "SpaceReserve", "auto_reserve", "is_full", "segment_cap"]
