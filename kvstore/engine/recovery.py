"""Bring the index in line with the segments when the store opens.

Rules (the index is a cache; segments are the truth):
- A sealed segment the index has not seen is indexed from its footer alone.
- An unsealed segment is scanned record header by record header; records past
  the point the index knows to be synced (``synced_upto``) also have their
  payload checksums verified. Records the index has not seen are replayed in
  order (puts and tombstones), so a replay from any earlier point converges.
- A bad record past that point is a torn tail: the segment is truncated there.
  Without an index (rebuild), a bad record is a torn tail only if no valid
  record follows it; otherwise it is corruption, reported and never skipped
  silently. A bad record before that point is corruption of acknowledged data:
  reported, its index entry kept (reads of it raise a corruption error).
- An unsealed segment that is not the tenant's newest was abandoned after a
  failed write: it is cut back to what the index acknowledged, and sealed.
- Index entries that point into missing segments or past a truncation are
  dropped; segments and index entries of tenants that no longer exist
  (crypto-shredded) are removed. A segment the object tier holds is not
  missing when its local copy is gone: its entries stay, and reads go there.
- With an object tier, segments in the bucket that the index does not know
  (a new node, a lost index) are indexed from their footers, fetched with
  ranged reads, in segment order together with the local ones; new segment
  ids start past every id in the bucket, so no upload can overwrite one.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.engine.appender import OpenSegment
from kvstore.engine.format import ALIGN, FooterEntry
from kvstore.engine.index import (
    SEG_OPEN,
    SEG_RETIRED,
    Index,
    IndexEntry,
    SegmentState,
)
from kvstore.engine.lifecycle import Lifecycle
from kvstore.engine.record import footer_entry, index_entry
from kvstore.engine.registry import Registry
from kvstore.engine.remote import RemoteFooter
from kvstore.engine.segment import SegmentFile, parse_segment_name
from kvstore.engine.tails import Tail
from kvstore.errors import ConfigError, CorruptionError, TierError, TierUnavailable
from kvstore.fsutil import fsync_dir

log = logging.getLogger("kvstore.engine.recovery")


@dataclass(slots=True)
class RecoveryReport:
    index_rebuilt: bool = False
    segments: int = 0
    segments_from_footer: int = 0
    segments_from_tier: int = 0  # indexed from footers in the object tier
    records_replayed: int = 0
    open_from_stop: int = 0  # open segments taken as the last clean stop left them (tails.py): no header read
    entries_dropped: int = 0
    truncated: list[tuple[str, int, int]] = field(default_factory=list)  # segment, offset, bytes cut
    corrupt: list[tuple[str, int, str]] = field(default_factory=list)  # segment, offset, what
    sealed: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    retired_removed: list[str] = field(default_factory=list)  # compacted segments' local files

    @property
    def repaired(self) -> bool:
        return bool(
            self.index_rebuilt
            or self.segments_from_footer
            or self.segments_from_tier
            or self.records_replayed
            or self.entries_dropped
            or self.truncated
            or self.sealed
            or self.orphans_removed
            or self.retired_removed
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "index_rebuilt": self.index_rebuilt,
            "segments": self.segments,
            "segments_from_footer": self.segments_from_footer,
            "segments_from_tier": self.segments_from_tier,
            "records_replayed": self.records_replayed,
            "open_from_stop": self.open_from_stop,
            "entries_dropped": self.entries_dropped,
            "truncated": [{"segment": s, "offset": o, "bytes": n} for s, o, n in self.truncated],
            "corrupt": [{"segment": s, "offset": o, "error": e} for s, o, e in self.corrupt],
            "sealed": self.sealed,
            "orphans_removed": self.orphans_removed,
            "retired_removed": self.retired_removed,
        }


class UnknownTenants(ConfigError):
    """The data directory holds tenants the registry does not know: starting
    would drop their data."""

    code = "unknown_tenants"

    def __init__(self, names: list[str], why: str = "does not list them") -> None:
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        super().__init__(
            f"the tenant registry (registry.json) {why}, but the data directory holds the data of tenant(s) "
            f"{shown}; refusing to start, which would drop it. Restore registry.json from a backup "
            "(or, with an object tier, PREFIX/registry.json in the bucket: it is fetched at start-up when the "
            "local file is missing); or start once with discard_unknown_tenants = true "
            "(--discard-unknown-tenants true) to delete their data"
        )
        self.names = names


@dataclass(frozen=True, slots=True)
class RemoteSegments:
    """One tenant's segments in the object tier (its current incarnation)."""

    objects: dict[int, int]  # segment id -> object size
    fetch: Callable[[int, int], RemoteFooter]  # (segment id, size) -> its footer; blocking
    # Start fetching these (segment id, size) footers at once, several at a time, for fetch to
    # find: a node rebuilt from the bucket, or a survivor taking over a dead node, reads them all.
    prefetch: Callable[[list[tuple[int, int]]], None] | None = None


TRASH = ".trash"  # segments/.trash/: directories of deleted tenants, removed in the background


def tenant_dirs(root: Path) -> set[str]:
    """Names of the tenant directories under ``root`` (the segments directory)."""
    if not root.is_dir():
        return set()
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}


def unknown_tenants(root: Path, registry: Registry) -> list[str]:
    """Tenants with data on disk that the registry neither holds nor says it
    deleted: the registry is not the one this data was written with."""
    return sorted(n for n in tenant_dirs(root) - set(registry.names()) if not registry.was_deleted(n))


def trash(root: Path, name: str) -> Path | None:
    """Move tenant directory ``name`` out of the way in one atomic rename (a
    crash leaves it whole or gone, never half-deleted under its name)."""
    src = root / name
    if not src.exists():
        return None
    bin_ = root / TRASH
    bin_.mkdir(exist_ok=True)
    dest = bin_ / f"{name}.{time.time_ns()}"
    os.rename(src, dest)
    fsync_dir(root)
    return dest


def recover(
    root: Path,
    index: Index,
    life: Lifecycle,
    registry: Registry,
    report: RecoveryReport,
    remote: Mapping[str, RemoteSegments] | None = None,
    id_floor: int = 0,
    discard_unknown: bool = False,
    stopped: Mapping[tuple[str, int], Tail] | None = None,
) -> dict[str, OpenSegment]:
    """Repair ``root`` (the segments directory) and ``index``; return each tenant's tail.

    ``stopped``: the open segments' footers a clean stop left (tails.py):
    an open segment found exactly as it was then is taken from there, its
    record headers not read.

    ``remote``: what the object tier holds, by tenant (None: no tier, or its
    listing failed; then the index's tier states are trusted). ``id_floor``:
    the lowest id a new segment may take. Directories of tenants the registry
    deleted are removed; those of tenants it does not know at all raise
    :class:`UnknownTenants` unless ``discard_unknown``."""
    root.mkdir(parents=True, exist_ok=True)
    unknown = unknown_tenants(root, registry)
    if unknown and not discard_unknown:
        raise UnknownTenants(unknown)
    shutil.rmtree(root / TRASH, ignore_errors=True)
    for name in sorted(tenant_dirs(root) - set(registry.names())):
        trash(root, name)
        life.tenant_deleted(name)
        report.orphans_removed.append(name)
        log.warning("removed segments of %s tenant %s", "deleted" if registry.was_deleted(name) else "unknown", name)
    shutil.rmtree(root / TRASH, ignore_errors=True)
    for name in sorted(index.tenants() - set(registry.names())):
        life.tenant_deleted(name)
    tails: dict[str, OpenSegment] = {}
    for name in registry.names():
        rem = None if remote is None else remote.get(name, RemoteSegments({}, _no_fetch))
        tails[name] = _recover_tenant(root / name, name, index, life, report, rem, id_floor, stopped or {})
    return tails


def _no_fetch(sid: int, size: int) -> RemoteFooter:
    raise TierError(f"segment {sid:016x} is not in the object tier")


def _recover_tenant(
    directory: Path,
    tenant: str,
    index: Index,
    life: Lifecycle,
    report: RecoveryReport,
    remote: RemoteSegments | None,
    id_floor: int,
    stopped: Mapping[tuple[str, int], Tail],
) -> OpenSegment:
    files: dict[int, Path] = {}
    if directory.is_dir():
        for p in directory.iterdir():
            sid = parse_segment_name(p.name)
            if sid is not None:
                files[sid] = p
            elif p.name.endswith(".tmp"):
                p.unlink()
    known = index.segments(tenant)
    objects = remote.objects if remote is not None else {}
    # Retired by compaction (every live record moved, durably): the local file
    # goes now; the compactor deletes the object once the copies are mirrored.
    retired = {sid for sid, st in known.items() if st.state == SEG_RETIRED}
    for sid in sorted(retired & set(files)):
        files.pop(sid).unlink()
        report.retired_removed.append(f"{tenant}/{sid:016x}.seg")
    known = {sid: st for sid, st in known.items() if sid not in retired}

    def in_tier(sid: int) -> bool:
        if remote is not None:
            return sid in objects
        ts = index.tier_state(tenant, sid)
        return ts is not None and ts.mirrored

    for sid in set(known) - set(files):
        if in_tier(sid):  # its local copy was dropped: reads go to the tier
            ts = index.tier_state(tenant, sid)
            if ts is None or ts.local or not ts.mirrored:
                life.found_in_tier(tenant, sid, objects.get(sid, ts.size if ts else 0), local=False)
    missing = {sid for sid in set(known) - set(files) if not in_tier(sid)}
    if missing:
        report.entries_dropped += index.drop_entries(tenant, lambda e: e.segment_id in missing)
        for sid in missing:
            life.deleted(tenant, sid)
            report.corrupt.append((f"{tenant}/{sid:016x}.seg", 0, "segment file is missing"))
    tail = OpenSegment(None, next_id=max([*files, *known, *retired, *objects, id_floor - 1, 0]) + 1)
    newest = max(files) if files else None
    from_tier = set(objects) - set(known) - set(files) - retired
    if from_tier and remote is not None and remote.prefetch is not None:
        remote.prefetch([(sid, objects[sid]) for sid in sorted(from_tier)])
    for sid in sorted(set(files) | from_tier):
        report.segments += 1
        if sid in from_tier:
            assert remote is not None
            _index_from_tier(tenant, sid, objects[sid], remote, life, report)
            continue
        state = known.get(sid)
        if state is not None and state.state != SEG_OPEN:
            # Sealed, as the index knows (a seal is never undone): nothing to read. Only its
            # size, where the object tier may hold it too.
            ts = index.tier_state(tenant, sid)
            if (ts is not None and not ts.local) or (ts is None and sid in objects):
                size = files[sid].stat().st_size
                if (ts is not None and not ts.local) or objects.get(sid) == size:
                    life.found_in_tier(tenant, sid, size, local=True)
            continue
        try:
            seg = SegmentFile.open(files[sid], writable=True)
        except CorruptionError as e:
            report.corrupt.append((f"{tenant}/{files[sid].name}", 0, str(e)))
            continue
        except OSError as e:
            report.corrupt.append((f"{tenant}/{files[sid].name}", 0, f"cannot open: {e.strerror}"))
            continue
        if seg.header.tenant != tenant or seg.segment_id != sid:
            report.corrupt.append((seg.name, 0, "segment header names another tenant or id"))
            seg.close()
            continue
        if seg.sealed:
            _recover_sealed(seg, state, life, report)
            ts = index.tier_state(tenant, sid)
            if (ts is not None and not ts.local) or (ts is None and objects.get(sid) == seg.size):
                # a local copy after all (eviction cut short), or an upload the index never heard of
                life.found_in_tier(tenant, sid, seg.size, local=True)
            seg.close()
            continue
        left = stopped.get((tenant, sid))
        if (
            left is not None
            and sid == newest
            and state is not None
            and state.state == SEG_OPEN
            and left.records_end == seg.size == state.indexed_upto == state.synced_upto
        ):
            # As the clean stop left it, and the index says so: no record header read, nothing to write.
            tail.segment, tail.synced_upto = seg, seg.size
            tail.stopped_footer(left.footer, left.entries)
            report.open_from_stop += 1
            continue
        footer = _recover_unsealed(seg, state, sid == newest, index, life, report)
        if sid == newest:
            tail.segment, tail.footer, tail.synced_upto = seg, footer, seg.size
        else:
            end = seg.size
            seg.seal(footer)
            life.replayed(tenant, sid, (), sealed=True, records_end=end)
            report.sealed.append(seg.name)
            seg.close()
    return tail


def _index_from_tier(
    tenant: str, sid: int, size: int, remote: RemoteSegments, life: Lifecycle, report: RecoveryReport
) -> None:
    name = f"{tenant}/{sid:016x}.seg (object tier)"
    try:
        footer = remote.fetch(sid, size)
    except TierUnavailable:
        raise  # start-up fails and is retried: indexing without it would lose its blocks
    except (CorruptionError, TierError) as e:
        report.corrupt.append((name, 0, str(e)))
        return
    index_tier_segment(life, tenant, sid, size, footer)
    report.segments_from_tier += 1
    report.records_replayed += len(footer.entries)


def index_tier_segment(life: Lifecycle, tenant: str, sid: int, size: int, footer: RemoteFooter) -> None:
    """Index a sealed segment that is only in the object tier, from its footer."""
    life.replayed(tenant, sid, _ops(sid, footer.entries), sealed=True, records_end=footer.records_end)
    life.found_in_tier(tenant, sid, size, local=False)


def _recover_sealed(seg: SegmentFile, state: SegmentState | None, life: Lifecycle, report: RecoveryReport) -> None:
    tenant, sid = seg.header.tenant, seg.segment_id
    if state is not None and state.state != SEG_OPEN:
        return
    end = seg.records_end()
    try:
        entries = seg.read_footer()
    except CorruptionError as e:
        report.corrupt.append((seg.name, end, str(e)))
        return
    if state is None:
        report.segments_from_footer += 1
    else:
        # Sealed after the index last heard of it. The index may also have
        # missed its last batches (an index not synced on every commit).
        entries = [fe for fe in entries if fe.offset >= state.indexed_upto]
    life.replayed(tenant, sid, _ops(sid, entries), sealed=True, records_end=end)
    report.records_replayed += len(entries)


def _recover_unsealed(
    seg: SegmentFile, state: SegmentState | None, newest: bool, index: Index, life: Lifecycle, report: RecoveryReport
) -> list[FooterEntry]:
    tenant, sid = seg.header.tenant, seg.segment_id
    known = state is not None
    synced = state.synced_upto if state else ALIGN
    indexed = state.indexed_upto if state else ALIGN
    # An abandoned segment keeps only what the index acknowledged.
    limit = indexed if (known and not newest) else None
    footer: list[FooterEntry] = []
    replay: list[FooterEntry] = []
    cut: int | None = None
    pending_error: tuple[int, CorruptionError] | None = None
    for item in seg.scan(ALIGN, verify_from=synced):
        if limit is not None and item.offset >= limit:
            cut = limit
            break
        if item.error is not None:
            if item.offset < synced:
                report.corrupt.append((seg.name, item.offset, str(item.error)))
                continue
            if known:
                cut = item.offset
                break
            if pending_error is not None:
                report.corrupt.append((seg.name, pending_error[0], str(pending_error[1])))
            pending_error = (item.offset, item.error)
            continue
        if pending_error is not None:  # a valid record follows: that was corruption, not a torn tail
            report.corrupt.append((seg.name, pending_error[0], str(pending_error[1])))
            pending_error = None
        assert item.header is not None
        if item.header.is_pad:
            continue  # space a write plan reserved and never committed
        fe = footer_entry(item.offset, item.header)
        footer.append(fe)
        if item.offset >= indexed or not known:
            replay.append(fe)
    if pending_error is not None:
        cut = pending_error[0]
    if cut is None and limit is not None and seg.size > limit:
        cut = limit
    if cut is not None and cut < seg.size:
        report.truncated.append((seg.name, cut, seg.size - cut))
        log.warning("truncating torn tail of %s at %d (%d bytes)", seg.name, cut, seg.size - cut)
        seg.truncate(cut)
        seg.sync()
        if known and cut < indexed:
            report.entries_dropped += index.drop_entries(tenant, lambda e: e.segment_id == sid and e.offset >= cut)
    life.replayed(tenant, sid, _ops(sid, replay), sealed=False, records_end=seg.size)
    report.records_replayed += len(replay)
    return footer


def _ops(sid: int, entries: list[FooterEntry]) -> list[tuple[str, IndexEntry | None]]:
    return [(fe.key, index_entry(sid, fe)) for fe in entries]
