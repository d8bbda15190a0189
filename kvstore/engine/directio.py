"""Writes that skip the page cache: O_DIRECT from page-aligned memory.

On this class of machine, copying a block into page-cache pages that are not
cached yet costs about 3 CPU-seconds per GB (the dearest stage of a put);
an ``O_DIRECT`` write moves the same bytes for about 0.1, with the data
going from the process's pages to the device. ``O_DIRECT`` asks three
things of every write: the file offset, the length and the memory address
of every buffer are multiples of the device's logical block size. Records
start and end on :data:`ALIGN` (4 KiB) boundaries in their segment
(format.py), so the offset and the total length always are; the buffers a
record is made of are not (a header of a few hundred bytes, frames,
padding). :func:`pwrite_direct` passes every buffer that starts on an
aligned address at an aligned place of the write through as it is (a body
received into an :class:`AlignedBuffer`: no copy at all) and copies the rest
(headers, padding, tails, sealed frames) into a pooled aligned staging
buffer, one ``pwritev`` per full stage.

Where the filesystem refuses ``O_DIRECT`` (tmpfs, some FUSE and network
filesystems) segments are written through the page cache as before; the
log says so once per filesystem. Durability is unchanged: a direct write is
not durable until ``fdatasync`` (the device's cache, the file's size).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from kvstore.buffers import POOL, BufferPool, address
from kvstore.engine.format import ALIGN

log = logging.getLogger("kvstore.engine.directio")

Buffer = bytes | bytearray | memoryview

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
STAGE_BYTES = 4 << 20  # staging bytes per pwritev
_IOV_MAX = 512


_probed: dict[int, bool] = {}
_probe_lock = threading.Lock()


def supported(directory: Path) -> bool:
    """Whether files in ``directory``'s filesystem open with O_DIRECT (asked
    once per filesystem; said in the log once where they do not)."""
    if not O_DIRECT:
        return False
    dev = os.stat(directory).st_dev
    with _probe_lock:
        known = _probed.get(dev)
        if known is not None:
            return known
        fstype = filesystem_type(directory)
        if fstype in IN_MEMORY:
            log.warning(
                "the data directory %s is on %s (memory): segments are written through the page cache,"
                " which is where a %s keeps them anyway (O_DIRECT there is emulated and brings nothing)",
                directory,
                fstype,
                fstype,
            )
            _probed[dev] = False
            return False
        probe = directory / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.warning(
                "the filesystem of %s does not take O_DIRECT: segments are written through the page cache"
                " (about 3 CPU-s per GB more than direct writes)",
                directory,
            )
            ok = False
        else:
            os.close(fd)
            ok = True
        finally:
            probe.unlink(missing_ok=True)
        _probed[dev] = ok
        return ok


# Filesystems whose files live in memory: Linux 6.6 and later accept O_DIRECT
# on tmpfs but serve it from the page cache, so it saves no copy there.
IN_MEMORY = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point
    above it in /proc/self/mountinfo); None where that cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best, fstype = "", None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields:
            continue
        mount = fields[4].replace("\\040", " ")
        kind = fields[fields.index("-") + 1]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, fstype = mount, kind
    return fstype


def open_direct(path: Path) -> int:
    """A write-only O_DIRECT descriptor of ``path`` (which exists)."""
    return os.open(path, os.O_WRONLY | O_DIRECT)


def pwrite_direct(fd: int, buffers: Sequence[Buffer], offset: int, pool: BufferPool = POOL) -> int:
    """Write ``buffers`` at ``offset`` through O_DIRECT descriptor ``fd``.
    ``offset`` and the buffers' total length must be multiples of ALIGN.
    Aligned runs of aligned buffers go to the device as they are; the rest is
    staged in pooled aligned memory. Returns the bytes written."""
    if offset % ALIGN:
        raise ValueError(f"direct write at offset {offset}, not a multiple of {ALIGN}")
    stage = pool.take(STAGE_BYTES)
    try:
        mem = stage.memory
        iov: list[memoryview] = []
        pending = 0  # bytes in iov
        staged = 0  # bytes of mem used so far (both in iov and not yet)
        flushed = 0  # bytes of mem already handed to iov
        pos = offset

        def emit(flush_all: bool) -> None:
            nonlocal iov, pending, pos, staged, flushed
            if staged > flushed:
                iov.append(mem[flushed:staged])
                pending += staged - flushed
                flushed = staged
            if iov and (flush_all or len(iov) >= _IOV_MAX or staged >= STAGE_BYTES):
                if pending % ALIGN:
                    raise ValueError(f"direct write of {pending} bytes, not a multiple of {ALIGN}")
                _pwritev_all(fd, iov, pos)
                pos += pending
                iov, pending = [], 0
                if staged >= STAGE_BYTES or flush_all:
                    staged = flushed = 0

        for b in buffers:
            v = memoryview(b).cast("B")
            while len(v):
                if (staged - flushed) % ALIGN == 0 and len(v) >= ALIGN and address(v) % ALIGN == 0:
                    whole = len(v) - len(v) % ALIGN
                    emit(False)
                    iov.append(v[:whole])
                    pending += whole
                    v = v[whole:]
                    if len(iov) >= _IOV_MAX:
                        emit(True)
                    continue
                room = STAGE_BYTES - staged
                n = min(room, len(v))
                mem[staged : staged + n] = v[:n]
                staged += n
                v = v[n:]
                if staged == STAGE_BYTES:
                    emit(True)
        emit(True)
        return pos - offset
    finally:
        stage.release()


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """pwritev every byte of ``views`` (a short direct write leaves an aligned remainder)."""
    views = list(views)
    pos = offset
    while views:
        n = os.pwritev(fd, views, pos)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        pos += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
