"""What a clean stop leaves for the next start: each open segment's footer so far.

An open segment has no footer on disk (it is written at the seal); the
appender keeps it in memory, and recovery rebuilds it by reading every
record header of every tenant's open segment, one read each: after a clean
stop too, so a start with many tenants read hundreds of thousands of
headers (issue 46: 63.7 s for 1,000 tenants of 100 blocks on a busy disk).
A clean stop writes them all into one file instead, ``DATA/open-footers``,
and the next start takes each one whose segment and index are exactly as
the stop left them, reading no record header; anything else (a crash since,
a segment changed, a file that does not check) is scanned as before.

The file is used once: the start that reads it removes it once recovery is
done, before any write, so a crash later in that run never meets a stale one.

Format (little-endian), version :data:`VERSION` (docs/operations.md, *Formats*)::

    header   8s magic "KVSTAIL1" | u16 version | u32 segments
    segment  u16 tenant name length | u64 segment id | u64 records end
             | u32 footer entries | u32 footer bytes
             | tenant name (ASCII) | footer (format.encode_footer)
    trailer  u64 checksum (format.checksum) of everything before it
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kvstore.engine.format import checksum
from kvstore.errors import FormatError, NewerFormat
from kvstore.fsutil import atomic_write, fsync_dir

log = logging.getLogger("kvstore.engine.recovery")

FILE_NAME = "open-footers"
MAGIC = b"KVSTAIL1"
VERSION = 1
VERSIONS_READ = (1,)
_HEAD = struct.Struct("<8sHI")
_SEGMENT = struct.Struct("<HQQII")
_TRAILER = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Tail:
    """One open segment as a clean stop left it: its footer encoded as a
    sealed segment's is (format.encode_footer), and its entries."""

    tenant: str
    segment_id: int
    records_end: int
    footer: bytes
    entries: int


def encode(tails: list[Tail]) -> bytes:
    parts = [_HEAD.pack(MAGIC, VERSION, len(tails))]
    for t in tails:
        name = t.tenant.encode("ascii")
        parts += [_SEGMENT.pack(len(name), t.segment_id, t.records_end, t.entries, len(t.footer)), name, t.footer]
    body = b"".join(parts)
    return body + _TRAILER.pack(checksum(body))


def decode(data: bytes, where: str) -> dict[tuple[str, int], Tail]:
    """The tails in ``data`` by (tenant, segment id); FormatError if it does
    not check, NewerFormat for a version this release does not read."""
    if len(data) < _HEAD.size + _TRAILER.size:
        raise FormatError("file is truncated", where)
    body, (want,) = data[: -_TRAILER.size], _TRAILER.unpack(data[-_TRAILER.size :])
    if checksum(body) != want:
        raise FormatError("checksum mismatch", where)
    magic, version, count = _HEAD.unpack_from(body)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}", where)
    if version not in VERSIONS_READ:
        raise NewerFormat(where, version, VERSIONS_READ, restore="remove it (the next start scans instead)")
    out: dict[tuple[str, int], Tail] = {}
    pos = _HEAD.size
    for _ in range(count):
        if pos + _SEGMENT.size > len(body):
            raise FormatError("file is truncated", where, pos)
        name_len, sid, end, entries, footer_len = _SEGMENT.unpack_from(body, pos)
        pos += _SEGMENT.size
        tenant = body[pos : pos + name_len].decode("ascii")
        pos += name_len
        footer = bytes(body[pos : pos + footer_len])  # decoded on first use (appender.OpenSegment)
        if len(footer) != footer_len:
            raise FormatError("file is truncated", where, pos)
        pos += footer_len
        out[(tenant, sid)] = Tail(tenant, sid, end, footer, entries)
    if pos != len(body):
        raise FormatError("trailing bytes", where, pos)
    return out


def write(root: Path, tails: list[Tail]) -> None:
    """At a clean stop: the open segments' footers, in one synced file."""
    atomic_write(root / FILE_NAME, encode(tails))


def read(root: Path) -> dict[tuple[str, int], Tail]:
    """At start-up: what the last clean stop left ({} if it left nothing or
    the file does not check). Recovery then calls :func:`discard`."""
    path = root / FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    try:
        return decode(data, str(path))
    except (FormatError, NewerFormat, UnicodeDecodeError) as e:
        log.warning("%s: %s; the open segments are scanned instead", path, e)
        return {}


def discard(root: Path) -> None:
    """Once recovery is done, before the store takes a write: the file is
    used once. (Left in place if recovery stopped, which changes no open
    segment it matched: the next start may use it again.)"""
    try:
        os.unlink(root / FILE_NAME)
    except FileNotFoundError:
        return
    fsync_dir(root)
