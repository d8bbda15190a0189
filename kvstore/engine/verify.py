"""Scrub: walk every segment and report what fails its checks.

Checks every record header (magic, version, flags, crc32), every stored frame
(xxh3-64), that a sealed segment's footer matches its records, and with
``deep`` every live frame of every block is opened (AES-GCM tag, zstd). Open
segments are checked up to what the index has acknowledged, so a scrub can
run while writes go on. It reports; it repairs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstore.engine.crypto import RecordCipher
from kvstore.engine.format import ALIGN, RecordHeader
from kvstore.engine.index import SEG_OPEN, Index
from kvstore.engine.record import footer_entry, open_frame
from kvstore.engine.registry import Registry
from kvstore.engine.segment import SegmentFile, parse_segment_name
from kvstore.errors import CorruptionError, KVStoreError


@dataclass(slots=True)
class VerifyReport:
    segments: int = 0
    records: int = 0
    bytes_checked: int = 0
    frames_opened: int = 0
    errors: list[tuple[str, int, str]] = field(default_factory=list)  # segment, offset, what

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "segments": self.segments,
            "records": self.records,
            "bytes_checked": self.bytes_checked,
            "frames_opened": self.frames_opened,
            "errors": [{"segment": s, "offset": o, "error": e} for s, o, e in self.errors],
        }


def verify_segments(root: Path, registry: Registry, index: Index | None, deep: bool) -> VerifyReport:
    """Scrub the segments of every tenant of ``registry``. ``index``: what
    it acknowledged of open segments (None: every record present is checked)."""
    report = VerifyReport()
    for tenant in registry.names():
        d = root / tenant
        if not d.is_dir():
            continue
        states = index.segments(tenant) if index is not None else {}
        for p in sorted(d.iterdir()):
            sid = parse_segment_name(p.name)
            if sid is None:
                continue
            report.segments += 1
            try:
                seg = SegmentFile.open(p)
            except (CorruptionError, OSError) as e:
                report.errors.append((f"{tenant}/{p.name}", 0, str(e)))
                continue
            try:
                st = states.get(sid)
                limit = st.indexed_upto if (st is not None and st.state == SEG_OPEN and not seg.sealed) else None
                _verify_segment(seg, registry, deep, limit, report)
            finally:
                seg.close()
    return report


def _verify_segment(seg: SegmentFile, registry: Registry, deep: bool, limit: int | None, report: VerifyReport) -> None:
    found = []
    for item in seg.scan(ALIGN, verify_from=ALIGN):
        if limit is not None and item.offset >= limit:
            break
        if item.error is not None or item.header is None:
            report.errors.append((seg.name, item.offset, str(item.error)))
            continue
        if item.header.is_pad:
            continue  # reserved space no record holds (a write plan's, never committed)
        report.records += 1
        report.bytes_checked += item.header.record_len
        found.append(footer_entry(item.offset, item.header))
        if deep and not item.header.is_tombstone:
            try:
                report.frames_opened += _open_all(seg, item.offset, item.header, registry)
            except KVStoreError as e:
                report.errors.append((seg.name, item.offset, str(e)))
    if seg.sealed:
        try:
            if seg.read_footer() != found:
                report.errors.append((seg.name, seg.records_end(), "footer does not match the segment's records"))
        except CorruptionError as e:
            report.errors.append((seg.name, seg.records_end(), str(e)))


def _open_all(seg: SegmentFile, offset: int, h: RecordHeader, registry: Registry) -> int:
    cipher = None
    if h.sealed:
        cipher = RecordCipher(
            registry.data_key(h.tenant, h.key_version),
            h.record_id,
            h.tenant,
            h.key,
            h.key_version,
            len(h.frames),
            h.logical_size,
        )
    payload = memoryview(seg.pread(offset + h.payload_offset, h.payload_len))
    pos = 0
    for i, f in enumerate(h.frames):
        out = bytearray(h.frame_plain_len(i))
        open_frame(cipher, h, i, payload[pos : pos + f.stored_len], memoryview(out), seg.name, offset)
        pos += f.stored_len
    return len(h.frames)
