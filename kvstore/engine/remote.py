"""Reading sealed segments that live in an object tier.

- :class:`FetchedRecord`: one record fetched with a single ranged GET, held in
  memory, read by the same decoding path as a local segment (reader.py), so
  identity, checksums and GCM tags are checked exactly as for local reads.
- :func:`fetch_footer`: a segment's header, trailer and footer by ranged reads
  (three small GETs, never the whole object): enough to index it.
- :func:`download_segment`: the whole object back to a local file (rehydration),
  checked before it is renamed into place.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvstore.engine.format import (
    ALIGN,
    TRAILER,
    FooterEntry,
    RecordHeader,
    SegmentHeader,
    Trailer,
    checksum,
    decode_footer,
    decode_record_header,
)
from kvstore.engine.segment import SegmentFile
from kvstore.errors import CorruptionError, FormatError
from kvstore.fsutil import fsync_dir
from kvstore.tier.base import Tier

T = TypeVar("T")
Run = Callable[..., Awaitable[T]]
DOWNLOAD_CHUNK = 8 << 20


class FetchedRecord:
    """Bytes [base, base + len(data)) of segment ``name``, held in memory; it
    answers the reads that :func:`kvstore.engine.reader.load` makes of a segment."""

    def __init__(self, data: bytes, base: int, name: str) -> None:
        self._data = memoryview(data)
        self._base = base
        self.name = name

    def pread(self, offset: int, length: int) -> memoryview:
        lo = offset - self._base
        if lo < 0 or lo + length > len(self._data):
            raise CorruptionError(
                f"read of {length} bytes at {offset} is outside the fetched record", self.name, offset
            )
        return self._data[lo : lo + length]

    def read_header_at(self, offset: int) -> RecordHeader:
        return decode_record_header(self.pread(offset, len(self._data) - (offset - self._base)), self.name, offset)


@dataclass(frozen=True, slots=True)
class RemoteFooter:
    entries: list[FooterEntry]
    records_end: int  # where the footer starts


FOOTER_TAIL = 64 << 10  # the object's end read at once: its trailer and, mostly, its footer (~600 entries)


async def fetch_footer(tier: Tier, name: str, size: int, tenant: str, segment_id: int) -> RemoteFooter:
    """The footer of the sealed segment object ``name`` (``size`` bytes), after
    checking its header names ``tenant`` and ``segment_id``. The header and
    the object's last :data:`FOOTER_TAIL` bytes are read at once (one round
    trip; a larger footer takes a second one)."""
    if size < ALIGN + TRAILER.size:
        raise FormatError(f"object is {size} bytes: too small to be a sealed segment", name)
    tail_at = max(ALIGN, size - FOOTER_TAIL)
    head, tail = await asyncio.gather(tier.read_range(name, 0, ALIGN), tier.read_range(name, tail_at, size - tail_at))
    header = SegmentHeader.decode(head, name)
    if header.tenant != tenant or header.segment_id != segment_id:
        raise FormatError(f"segment header names {header.tenant}/{header.segment_id:016x}", name)
    t = Trailer.decode(tail[-TRAILER.size :], name)
    if t.footer_offset + t.footer_len + TRAILER.size != size or t.footer_offset % ALIGN:
        raise FormatError("trailer does not describe this object", name, size - TRAILER.size)
    if t.footer_offset >= tail_at:
        raw = bytes(tail[t.footer_offset - tail_at : t.footer_offset - tail_at + t.footer_len])
    else:
        raw = await tier.read_range(name, t.footer_offset, t.footer_len)
    if checksum(raw) != t.footer_checksum:
        raise FormatError("segment footer checksum mismatch", name, t.footer_offset)
    return RemoteFooter(decode_footer(raw, t.entry_count, name), t.footer_offset)


async def download_segment(tier: Tier, name: str, size: int, dest: Path, run: Run[None]) -> None:
    """Copy object ``name`` to ``dest``: written under a ``.tmp`` name (recovery
    removes leftovers), synced, opened and its footer checked, then renamed."""
    tmp = dest.with_name(dest.name + ".rehydrate.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, size, DOWNLOAD_CHUNK):
            data = await tier.read_range(name, off, min(DOWNLOAD_CHUNK, size - off))
            await run(_pwrite, fd, data, off)
        await run(os.fsync, fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)

    def check_and_place() -> None:
        try:
            seg = SegmentFile.open(tmp)
            try:
                if not seg.sealed:
                    raise FormatError("downloaded segment has no valid trailer", name)
                seg.read_footer()
            finally:
                seg.close()
            os.rename(tmp, dest)
            fsync_dir(dest.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    await run(check_and_place)


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
