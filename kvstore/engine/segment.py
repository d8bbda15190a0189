"""One segment file: append batches, read records, scan, seal with a footer.

Writes go through ``os.pwritev`` and ``os.fdatasync`` looked up on the ``os``
module at call time, so fault tests can replace exactly those syscalls.
Records are appended through a second, ``O_DIRECT`` descriptor once
:meth:`SegmentFile.use_direct_io` opened one (directio.py): no page-cache
copy; the header, the footer and reads use the ordinary descriptor. Nothing
here knows about tenants' keys, the index, or asyncio.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.engine import directio
from kvstore.engine.format import (
    ALIGN,
    REC_MAGIC,
    RECORD_HEADER,
    TRAILER,
    FooterEntry,
    RecordHeader,
    SegmentHeader,
    Trailer,
    align_up,
    checksum,
    decode_footer,
    decode_record_header,
    encode_footer,
    peek_header_len,
)
from kvstore.errors import CorruptionError, FormatError
from kvstore.fsutil import fsync_dir

log = logging.getLogger("kvstore.engine.segment")

Buffer = bytes | bytearray | memoryview
_IOV_MAX = 512
_SCAN_CHUNK = 1 << 20


def segment_name(segment_id: int) -> str:
    return f"{segment_id:016x}.seg"


def parse_segment_name(name: str) -> int | None:
    if len(name) == 20 and name.endswith(".seg"):
        try:
            return int(name[:16], 16)
        except ValueError:
            return None
    return None


@dataclass(frozen=True, slots=True)
class ScanItem:
    """A record found by :meth:`SegmentFile.scan`, or the error at ``offset``."""

    offset: int
    header: RecordHeader | None
    error: CorruptionError | None = None


class SegmentFile:
    """An open segment file. ``size`` is where the next record goes."""

    def __init__(self, path: Path, header: SegmentHeader, fd: int, size: int, sealed: bool) -> None:
        self.path = path
        self.header = header
        self.fd = fd
        self.size = size
        self.sealed = sealed
        self.dfd = -1  # the O_DIRECT descriptor records are appended through (-1: none)
        self._direct_refused = False
        self._map: mmap.mmap | None = None
        self._map_lock = threading.Lock()
        self._users = 0  # reads in progress (acquire/release)
        self._retired = False
        # The verified-frames cache of this open file (verified.py): record
        # offset -> (its header, a bit per frame whose checksum was checked).
        # It lives and dies with this object: compaction, eviction and
        # rehydration replace or close it, so nothing here outlives the bytes.
        self.verified: dict[int, tuple[RecordHeader, int]] = {}

    @property
    def segment_id(self) -> int:
        return self.header.segment_id

    @property
    def name(self) -> str:
        return f"{self.header.tenant}/{self.path.name}"

    def __repr__(self) -> str:
        return f"SegmentFile({self.name}, size={self.size}, sealed={self.sealed})"

    # -- open / create --------------------------------------------------------

    @classmethod
    def create(cls, directory: Path, tenant: str, segment_id: int, direct: bool) -> SegmentFile:
        """A new segment holding just its header. The header is written and synced
        under a ``.tmp`` name (recovery removes those) and then renamed into place,
        so a crash never leaves a segment file without a complete header."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / segment_name(segment_id)
        if path.exists():
            raise FileExistsError(errno.EEXIST, "segment file exists", str(path))
        tmp = path.with_name(path.name + ".tmp")
        header = SegmentHeader(segment_id, tenant, direct, time.time_ns())
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pwrite_all(fd, [header.encode()], 0)
            os.fdatasync(fd)
            os.rename(tmp, path)
            fsync_dir(directory)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            raise
        return cls(path, header, fd, ALIGN, sealed=False)

    @classmethod
    def open(cls, path: Path, writable: bool = False) -> SegmentFile:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            header = SegmentHeader.decode(os.pread(fd, ALIGN, 0), f"{path.parent.name}/{path.name}")
            seg = cls(path, header, fd, size, sealed=False)
            seg.sealed = seg.read_trailer() is not None
            return seg
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        self._map = None  # views still being sent keep their mapping alive
        self._close_direct()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- sharing with readers whose file may be dropped -----------------------

    def acquire(self) -> bool:
        """Hold the file open for a read; False once it is retired (dropped)."""
        with self._map_lock:
            if self._retired or self.fd < 0:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._map_lock:
            self._users -= 1
            if self._retired and self._users == 0:
                self.close()

    def retire(self) -> None:
        """No new reads; close the file once the reads in progress end (so its
        descriptor is never reused under a read, and its space comes back)."""
        with self._map_lock:
            self._retired = True
            if self._users == 0:
                self.close()

    # -- writing --------------------------------------------------------------

    def use_direct_io(self) -> bool:
        """Append records through an O_DIRECT descriptor from now on; False
        where the file will not open with O_DIRECT."""
        if self.dfd < 0 and not self._direct_refused:
            try:
                self.dfd = directio.open_direct(self.path)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_refused = True
        return self.dfd >= 0

    def _close_direct(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1

    def append(self, buffers: Sequence[Buffer]) -> int:
        """Write ``buffers`` at the end; return their offset. Not synced.
        Their total length is a multiple of ALIGN when O_DIRECT is in use."""
        offset = self.size
        if self.dfd >= 0:
            try:
                total = directio.pwrite_direct(self.dfd, buffers, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                # Refused at write time (a device with a bigger logical block, say): this
                # file goes through the page cache from now on; the batch is written again.
                log.warning("O_DIRECT write to %s refused (%s): writing it through the page cache", self.name, e)
                self._close_direct()
                self._direct_refused = True
                total = pwrite_all(self.fd, buffers, offset)
        else:
            total = pwrite_all(self.fd, buffers, offset)
        self.size = offset + total
        return offset

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        self.size = size

    def seal(self, entries: list[FooterEntry]) -> None:
        """Append the footer and trailer and sync: the segment is immutable from now."""
        footer = encode_footer(entries)
        offset = self.size
        trailer = Trailer(offset, len(footer), len(entries), checksum(footer), time.time_ns())
        self._close_direct()  # no more records
        try:
            pwrite_all(self.fd, [footer, trailer.encode()], offset)
            os.fdatasync(self.fd)
        except BaseException:
            # The segment stays open: cut the footer and trailer off, or records
            # appended later would lie inside what a stale trailer calls its footer.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, offset)
            raise
        self.size = offset + len(footer) + TRAILER.size
        self.sealed = True

    # -- reading --------------------------------------------------------------

    def pread(self, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        self.preadinto(memoryview(buf), offset)
        return buf

    def preadinto(self, buf: memoryview, offset: int) -> None:
        self.preadv_into([buf], offset)

    def preadv_into(self, buffers: list[memoryview], offset: int) -> None:
        """Fill ``buffers`` from the file at ``offset`` (one preadv when it can)."""
        views = [b for b in buffers if len(b)]
        pos = offset
        while views:
            n = os.preadv(self.fd, views, pos)
            if n == 0:
                missing = sum(len(v) for v in views)
                raise CorruptionError(f"segment ends at {pos}; expected {missing} more bytes", self.name, offset)
            pos += n
            _consume(views, n)

    def mapped(self, end: int) -> memoryview:
        """A read-only view of the file's first ``end`` bytes, from a shared
        mapping (remapped when the segment has grown past it). Only bytes the
        index points at may be touched: they are never truncated while open."""
        m = self._map
        if m is None or len(m) < end:
            with self._map_lock:
                m = self._map
                if m is None or len(m) < end:
                    size = os.fstat(self.fd).st_size
                    if size < end:
                        raise CorruptionError(f"segment is {size} bytes; a record ends at {end}", self.name, end)
                    m = self._map = mmap.mmap(self.fd, size, access=mmap.ACCESS_READ)
        return memoryview(m)[:end]

    def read_header_at(self, offset: int) -> RecordHeader:
        first = self.pread(offset, min(ALIGN, max(0, self.size - offset))) if offset < self.size else b""
        header_len = peek_header_len(first, self.name, offset)
        if header_len > len(first):
            first = self.pread(offset, header_len)
        return decode_record_header(first, self.name, offset)

    def verify_payload(self, offset: int, header: RecordHeader) -> None:
        """Check every stored frame of the record at ``offset`` against its checksum."""
        payload = memoryview(self.pread(offset + header.payload_offset, header.payload_len))
        pos = 0
        for i, f in enumerate(header.frames):
            if checksum(payload[pos : pos + f.stored_len]) != f.checksum:
                raise CorruptionError(f"frame {i} of key {header.key!r} fails its checksum", self.name, offset)
            pos += f.stored_len

    def read_trailer(self) -> Trailer | None:
        if self.size < ALIGN + TRAILER.size:
            return None
        try:
            t = Trailer.decode(os.pread(self.fd, TRAILER.size, self.size - TRAILER.size), self.name)
        except FormatError:
            return None
        if t.footer_offset + t.footer_len + TRAILER.size != self.size or t.footer_offset % ALIGN:
            return None
        return t

    def read_footer(self) -> list[FooterEntry]:
        t = self.read_trailer()
        if t is None:
            raise FormatError("segment has no valid trailer", self.name)
        raw = self.pread(t.footer_offset, t.footer_len)
        if checksum(raw) != t.footer_checksum:
            raise FormatError("segment footer checksum mismatch", self.name, t.footer_offset)
        return decode_footer(raw, t.entry_count, self.name)

    def records_end(self) -> int:
        """Where records stop: the footer offset if sealed, else the file size."""
        t = self.read_trailer() if self.sealed else None
        return t.footer_offset if t else self.size

    def scan(self, start: int = ALIGN, verify_from: int | None = None) -> Iterator[ScanItem]:
        """Walk records from ``start``, checking the payload checksums of records
        at or after ``verify_from`` (None: headers only). A bad record yields an
        error item, then the scan resumes at the next ALIGN boundary that holds a
        valid record header."""
        end = self.records_end()
        pos = start
        while pos < end:
            try:
                h = self.read_header_at(pos)
                if pos + h.record_len > end:
                    raise FormatError("record runs past the end of the segment", self.name, pos)
                if verify_from is not None and pos >= verify_from:
                    self.verify_payload(pos, h)
            except CorruptionError as e:
                yield ScanItem(pos, None, e)
                nxt = self._next_valid_header(pos + ALIGN, end)
                if nxt is None:
                    return
                pos = nxt
                continue
            yield ScanItem(pos, h)
            pos += h.record_len

    def _next_valid_header(self, start: int, end: int) -> int | None:
        pos = start
        while pos < end:
            chunk = self.pread(pos, min(_SCAN_CHUNK, end - pos))
            for off in range(0, len(chunk), ALIGN):
                if chunk[off : off + 4] == REC_MAGIC and len(chunk) - off >= RECORD_HEADER.size:
                    try:
                        h = self.read_header_at(pos + off)
                    except CorruptionError:
                        continue
                    if pos + off + h.record_len <= end:
                        return pos + off
            pos += len(chunk)
        return None


def pwrite_all(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
    """pwritev every byte of ``buffers`` at ``offset`` (retrying short writes)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    written = 0
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset + written)
        written += n
        _consume(views, n)
    return total


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from ``views`` (after a short read or write)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]


def padding(n: int) -> bytes:
    """Zero bytes that bring ``n`` up to the next ALIGN boundary."""
    return bytes(align_up(n) - n)
