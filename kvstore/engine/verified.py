"""The verified-frames cache: a frame's checksum checked once per open segment
file, not on every read.

A read of a direct block sends the bytes of its segment's mapping (or the
kernel sends them with sendfile), after checking the xxh3 of every frame the
range touches. Engines read a layer's slice or a TP rank's part of a block
at a time, so a 1 MiB frame used to be hashed again for every 256 KiB read.
Records are immutable once indexed, so each :class:`~kvstore.engine.segment.SegmentFile`
remembers which frames of which records it has verified (a bit per frame, with
the decoded record header), and later reads of those frames check only the
record's identity against the index entry.

What invalidates it:

- the segment file going: compaction retires it, eviction drops it,
  rehydration opens a new one, a tenant's deletion closes its files. The
  cache is an attribute of the open file object, so it goes with it (and
  reader workers close theirs when the index's epoch moves);
- a corruption report: a read that finds a frame or header damaged forgets
  the whole file's cache (:func:`forget`), and a scrub (``POST
  /v1/admin/verify``), which always reads the disk and never this cache,
  forgets the cache of every segment it found damaged in this process and
  bumps the index's epoch, which makes every reader worker forget theirs.

What it does not see: bytes damaged on disk *after* their frame was verified
in this file's lifetime are served as they are until a scrub finds them (or
the file is closed and reopened), as nginx would serve them. The checks a
read still makes every time: the record header's identity against the index
(tenant, key, record id, size), so a read never sends another block's bytes.
"""

from __future__ import annotations

from kvstore.engine.format import RecordHeader
from kvstore.engine.segment import SegmentFile

__all__ = ["forget", "frames_mask", "header_of", "mark", "unverified"]


def frames_mask(first: int, last: int) -> int:
    """The bits of frames ``first``..``last``."""
    return ((1 << (last - first + 1)) - 1) << first


def header_of(seg: SegmentFile, offset: int) -> RecordHeader | None:
    """The decoded header of the record at ``offset``, if a read verified it before."""
    known = seg.verified.get(offset)
    return None if known is None else known[0]


def unverified(seg: SegmentFile, offset: int, first: int, last: int) -> bool:
    """Whether any of frames ``first``..``last`` of the record at ``offset``
    still has to be checked in this file."""
    known = seg.verified.get(offset)
    want = frames_mask(first, last)
    return known is None or known[1] & want != want


def mark(seg: SegmentFile, offset: int, header: RecordHeader, first: int, last: int) -> None:
    """Frames ``first``..``last`` of the record at ``offset`` passed their
    checksums. (Two threads marking at once may lose a bit: that frame is
    only checked again.)"""
    known = seg.verified.get(offset)
    seg.verified[offset] = (header, (known[1] if known is not None else 0) | frames_mask(first, last))


def forget(seg: SegmentFile) -> None:
    """Check every frame of this file again from now on (corruption was reported)."""
    seg.verified = {}
