"""Compaction: give back the space of deleted, expired and evicted records.

A sealed segment whose dead bytes reach ``compact_dead_percent`` of its
records is rewritten: each record that is still live is copied *as it is*
(ciphertext and all: a record's identity, which its AAD binds, does not
depend on where it lies) through the tenant's appender into its open segment,
in order with every other write, and only if the key's entry still points at
it when the copy's batch is written. Then:

1. the copies are made durable (segment and index synced, whatever the policy);
2. the old segment is *retired* (lifecycle.py), and its local file goes (once
   no lease holds it: a leased file stays until the lease ends);
3. if it was in the object tier, its object goes once every segment up to
   the one holding the copies is mirrored (the appender seals the copies'
   segment at the end of the pass, so that happens soon);
4. the segment is forgotten.

Why a crash anywhere loses nothing and brings nothing back:

- Before 1, the copies may be lost, but the old segment is untouched and the
  index still points at it (a copy's entry is committed with its batch, and
  the index is rebuilt from segments in id order: a copy, which is newer,
  simply wins; it has the same bytes).
- A tombstone is copied forward while the record it deleted may still be
  found by an index rebuild (its segment, which the tombstone names, still
  exists) and the key was not written again since: dropping it could bring a
  deleted block back. A copied tombstone is conditional too: written only if
  the key is still absent. Tombstones that must stay count as live when a
  segment is weighed, so a segment of them is not rewritten over and over.
- Between 1 and 4 both copies may exist; the newer wins everywhere (index
  rebuild, rebuild of a node from the bucket), and the old one is removed by
  recovery (local file) or the next pass (object).

I/O is bounded: a pass reads at most ``compact_rate`` bytes per second, so
foreground reads keep their latency. ``POST /v1/admin/compact`` runs a pass
now; the background loop runs one every ``compact_interval_s``.

On a full disk (the space reserve in use, or puts refused for space: see
reserve.py) a pass runs at once and then every second while the disk stays
full, whatever ``compact_interval_s`` says, and chooses differently: any
sealed segment with at least ``PRESSED_DEAD_PERCENT`` dead, the one that
frees the most for the least copying first, and only if its live records
fit in the space left; an open segment with that much dead is sealed first
so it can be taken. Its copies and seals may use the reserve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import StoreConfig
from kvstore.engine.appender import Appender
from kvstore.engine.format import ALIGN, KIND_TOMBSTONE, FooterEntry, checksum, decode_record_header
from kvstore.engine.index import SEG_OPEN, SEG_RETIRED, SEG_SEALED, Index, IndexEntry
from kvstore.engine.lifecycle import Leases, Lifecycle, LifecycleError, Phase
from kvstore.engine.record import EncodedRecord, index_entry
from kvstore.engine.registry import Registry
from kvstore.engine.residency import Residency
from kvstore.engine.segcache import SegmentCache
from kvstore.errors import CorruptionError, KeyReserved, KVStoreError, TierError
from kvstore.metrics import Metrics
from kvstore.tasks import wait_event

log = logging.getLogger("kvstore.engine.compactor")
SegmentKey = tuple[str, int]
PRESSED_POLL_S = 1.0  # passes while the disk is full
PRESSED_DEAD_PERCENT = 10  # the dead share that makes a segment worth rewriting on a full disk
PRESSED_SEAL_MIN = 1 << 20  # dead bytes of an open segment worth sealing it for, on a full disk
MERGE_MIN_SEGMENTS = 4  # small sealed segments a tenant has before a pass merges them (merge_below)
MERGE_BATCH = 64  # small segments merged between two syncs: their copies made durable, then each retired
IDLE_S = 3600.0  # the loop's wait with no interval and no pressure (a kick ends it)


@dataclass(slots=True)
class CompactionReport:
    segments_rewritten: int = 0
    segments_merged: int = 0  # of those, small ones merged (merge_below)
    records_copied: int = 0
    tombstones_copied: int = 0
    bytes_copied: int = 0
    bytes_reclaimed: int = 0  # local segment files removed
    objects_deleted: int = 0  # object-tier copies removed
    seconds: float = 0.0
    deferred: int = 0  # segments left for a later pass: a key in them has a write plan open
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "segments_rewritten": self.segments_rewritten,
            "segments_merged": self.segments_merged,
            "records_copied": self.records_copied,
            "tombstones_copied": self.tombstones_copied,
            "bytes_copied": self.bytes_copied,
            "bytes_reclaimed": self.bytes_reclaimed,
            "objects_deleted": self.objects_deleted,
            "seconds": round(self.seconds, 3),
            "deferred": self.deferred,
            "errors": self.errors,
        }


class _Throttle:
    """At most ``rate`` bytes per second, on average over the pass."""

    def __init__(self, rate: int) -> None:
        self._rate = rate
        self._start = time.monotonic()
        self._bytes = 0

    async def spent(self, nbytes: int) -> None:
        self._bytes += nbytes
        ahead = self._start + self._bytes / self._rate - time.monotonic()
        if ahead > 0:
            await asyncio.sleep(ahead)


class Compactor:
    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        lifecycle: Lifecycle,
        leases: Leases,
        registry: Registry,
        cache: SegmentCache,
        residency: Residency,
        appender: Callable[[str], Appender],
        run: Callable[..., Awaitable[Any]],
        metrics: Metrics,
        available: Callable[[], int] | None = None,
    ) -> None:
        """``residency`` says where each segment's bytes are, and whether the
        disk is full; ``available``: bytes maintenance may still write
        (blocking)."""
        self._cfg = config
        self._index = index
        self._life = lifecycle
        self._leases = leases
        self._registry = registry
        self._cache = cache
        self._residency = residency
        self._appender = appender
        self._run = run
        self._metrics = metrics
        self._available = available
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    def _pressed(self) -> bool:
        """Whether the disk is full (reserve.py): compaction runs now, and chooses differently."""
        return self._residency.full

    def kick(self) -> None:
        """The disk may have filled: run a pass now (the loop decides)."""
        self._wake.set()

    async def loop(self) -> None:
        """The background compactor: a pass every ``compact_interval_s`` (0:
        none), and at once and every second while the disk is full."""
        interval = self._cfg.compact_interval_s
        while True:
            timeout = PRESSED_POLL_S if self._pressed() else (interval or IDLE_S)
            woken = await wait_event(self._wake, timeout)
            self._wake.clear()
            if not self._pressed() and (woken or not interval):
                continue
            try:
                report = await self.compact()
                if report.segments_rewritten or report.objects_deleted:
                    log.info("compaction: %s", report.as_dict())
            except Exception:
                log.exception("compaction pass failed")

    async def compact(self, tenant: str | None = None) -> CompactionReport:
        """One pass over ``tenant`` (None: every tenant); returns what it did."""
        async with self._lock:
            t0 = time.monotonic()
            report = CompactionReport()
            pressed = self._pressed()
            throttle = _Throttle(self._cfg.compact_rate * (4 if pressed else 1))
            for name in [tenant] if tenant is not None else self._registry.names():
                try:
                    await self._compact_tenant(name, report, throttle, pressed)
                except KVStoreError as e:  # the tenant went meanwhile, or its appender is closing
                    report.errors.append(f"{name}: {e}")
            await self.reap(report, tenant)
            report.seconds = time.monotonic() - t0
            m = self._metrics
            m.inc("kvstore_compaction_passes_total")
            m.inc("kvstore_compaction_segments_total", report.segments_rewritten)
            m.inc("kvstore_compaction_segments_merged_total", report.segments_merged)
            m.inc("kvstore_compaction_bytes_copied_total", report.bytes_copied)
            m.inc("kvstore_compaction_bytes_reclaimed_total", report.bytes_reclaimed)
            return report

    # -- choosing ---------------------------------------------------------------

    def _threshold(self, pressed: bool) -> int:
        return min(PRESSED_DEAD_PERCENT, self._cfg.compact_dead_percent) if pressed else self._cfg.compact_dead_percent

    def _candidates(self, tenant: str, pressed: bool = False) -> list[tuple[int, int]]:
        """Sealed segments of ``tenant`` to rewrite, each with the dead share
        (percent) that makes the rewrite worth it: those dead enough, oldest
        first; on a full disk, the most dead first (and least live among
        equals), leaving out those whose live records do not fit in the space
        left. Besides, when not pressed: the small ones to merge (under
        ``merge_below``, once there are :data:`MERGE_MIN_SEGMENTS`; worth it
        whatever their dead share)."""
        live = self._index.live(tenant)
        threshold = self._threshold(pressed)
        room = self._available() if pressed and self._available is not None else None
        out: list[tuple[float, int, int]] = []
        small: list[int] = []
        below = 0 if pressed else self._cfg.merge_threshold
        for sid, st in sorted(self._index.segments(tenant).items()):
            if st.state != SEG_SEALED:
                continue
            total = st.indexed_upto - ALIGN
            kept = live.get(sid, (0, 0))[1]
            dead = total - kept
            if total <= 0 or dead * 100 < threshold * total:
                if total > 0 and st.indexed_upto < below:
                    small.append(sid)
                continue
            if room is not None and not _fits(kept, room):
                continue  # copying it would fill the disk before its space came back
            out.append((-dead / total if pressed else 0.0, kept if pressed else 0, sid))
        chosen = [(sid, threshold) for *_, sid in sorted(out)]
        if len(small) >= MERGE_MIN_SEGMENTS:
            chosen = sorted(chosen + [(sid, 0) for sid in small])  # oldest first
        return chosen

    def _room_for(self, tenant: str, sid: int) -> bool:
        """Whether the live records of ``sid`` fit in the space maintenance may
        still write, asked right before it is copied: the segments rewritten
        before it in the pass may not have given their space back yet (a
        reader process still holds their files open, say)."""
        if self._available is None:
            return True
        kept = self._index.live_of(tenant, sid)[1]
        return _fits(kept, self._available())

    def _open_worth_sealing(self, tenant: str, sid: int) -> bool:
        """On a full disk: whether the open segment ``sid`` holds enough dead
        records that sealing it (so a pass can rewrite it) pays."""
        st = self._index.segment(tenant, sid)
        if st is None or st.state != SEG_OPEN:
            return False
        total = st.indexed_upto - ALIGN
        dead = total - self._index.live(tenant).get(sid, (0, 0))[1]
        return dead >= PRESSED_SEAL_MIN and dead * 100 >= self._threshold(True) * total

    async def _compact_tenant(
        self, tenant: str, report: CompactionReport, throttle: _Throttle, pressed: bool = False
    ) -> None:
        """Rewrite the tenant's candidates one by one: each one's copies are
        made durable and it is retired, and its local file removed, before
        the next is weighed, so the next one's tombstones that only guarded
        it can go. Small segments merged (``merge_below``) go in batches of
        :data:`MERGE_BATCH`: their copies made durable once, then each
        retired (a tombstone that guarded a segment of the same batch is
        carried forward: nothing deleted comes back)."""
        incarnation = self._registry.get(tenant).created_ns
        if pressed:
            app = self._appender(tenant)
            current = app.open_segment
            if current is not None and await self._run(self._open_worth_sealing, tenant, current):
                await app.seal()
        sids = await self._run(self._candidates, tenant, pressed)
        if not sids:
            return
        app = self._appender(tenant)
        in_tier = False
        merged: list[tuple[int, Phase]] = []  # small segments copied, not retired yet: claimed

        def alive() -> bool:
            return tenant in self._registry and self._registry.get(tenant).created_ns == incarnation

        async def settle() -> None:
            """The merged segments' copies made durable once, then each retired."""
            nonlocal in_tier
            try:
                if merged:
                    await app.make_durable()
                    if alive():
                        upto = 0  # where the copies went: objects go once it is mirrored (reap())
                        if any(phase is not Phase.SEALED for _, phase in merged):
                            in_tier = True
                            upto = app.open_segment or await self._run(self._newest_sealed, tenant)
                        retiring = [(sid, 0 if phase is Phase.SEALED else upto) for sid, phase in merged]
                        await self._retire(tenant, retiring, report)
            finally:
                for sid, _ in merged:
                    self._leases.unclaim((tenant, sid))
                merged.clear()

        try:
            for sid, threshold in sids:
                if threshold or len(merged) >= MERGE_BATCH:
                    await settle()
                if not alive():
                    return  # deleted (and maybe created again) meanwhile: its segments are not these
                key = (tenant, sid)
                if not self._leases.try_claim(key):
                    continue  # being dropped, or leased: next pass
                kept = False
                try:
                    phase = await self._run(self._life.phase, tenant, sid)
                    if phase not in (Phase.SEALED, Phase.MIRRORED, Phase.REMOTE_ONLY):
                        continue
                    if not await self._run(self._room_for, tenant, sid):
                        continue  # next pass: the space of those rewritten so far has not come back yet
                    if not await self._copy_live(tenant, sid, phase, app, report, throttle, threshold):
                        continue
                    if threshold == 0:  # a small one merged: retired with the rest of its batch
                        report.segments_merged += 1
                        merged.append((sid, phase))
                        kept = True
                        continue
                    await app.make_durable()
                    if not alive():
                        return
                    # Its object, if it has one, goes once every segment up to the
                    # one the copies went to is mirrored (reap()).
                    wait_upto = 0
                    if phase is not Phase.SEALED:
                        in_tier = True
                        wait_upto = app.open_segment or await self._run(self._newest_sealed, tenant)
                    await self._retire(tenant, [(sid, wait_upto)], report)
                except (CorruptionError, TierError, OSError) as e:
                    report.errors.append(f"{tenant}/{sid:016x}: {e}")
                    log.error("compaction of %s/%016x stopped: %s", tenant, sid, e)
                finally:
                    if not kept:
                        self._leases.unclaim(key)
            await settle()
        finally:
            for sid, _ in merged:  # (a pass cut short: nothing retired, the claims let go)
                self._leases.unclaim((tenant, sid))
        if in_tier:
            await app.seal()  # the copies' segment is sealed, so it is mirrored soon

    def _newest_sealed(self, tenant: str) -> int:
        return max((sid for sid, st in self._index.segments(tenant).items() if st.state == SEG_SEALED), default=0)

    # -- copying ----------------------------------------------------------------

    async def _copy_live(
        self,
        tenant: str,
        sid: int,
        phase: Phase,
        app: Appender,
        report: CompactionReport,
        throttle: _Throttle,
        threshold: int,
    ) -> bool:
        """Copy the live records (and needed tombstones) of one segment, if
        that gives back ``threshold`` percent of it (0: a merge, always);
        True when nothing live is left in it."""
        local = phase is not Phase.REMOTE_ONLY
        seg = await self._run(self._cache.acquire, (tenant, sid)) if local else None
        if local and seg is None:
            raise CorruptionError("segment file is missing", f"{tenant}/{sid:016x}.seg", 0)
        try:
            entries = await self._residency.read_footer(tenant, sid, seg)
            needed: set[int] = set()
            if any(fe.kind == KIND_TOMBSTONE for fe in entries):
                needed = await self._run(self._tombstones_needed, tenant, sid, entries)
            if threshold and not await self._run(self._worth_it, tenant, sid, entries, needed, threshold):
                return False  # mostly tombstones that must stay: moving them would give nothing back
            for fe in entries:
                if fe.kind == KIND_TOMBSTONE:
                    if fe.offset not in needed:
                        continue  # what it deleted is gone, or the key was written again
                    expect: IndexEntry | None = None
                else:
                    expect = index_entry(sid, fe)
                    if self._index.get(tenant, fe.key) != expect:
                        continue  # dead: deleted, replaced, expired or evicted
                raw = await self._residency.read_record(tenant, sid, seg, fe.offset, fe.record_len)
                record = await self._run(_checked_record, raw, tenant, fe, f"{tenant}/{sid:016x}.seg")
                try:
                    copied = await app.copy(record, expect)
                except KeyReserved:
                    report.deferred += 1  # its tombstone must stay until the write plan ends
                    return False
                if copied:
                    if fe.kind == KIND_TOMBSTONE:
                        report.tombstones_copied += 1
                    else:
                        report.records_copied += 1
                    report.bytes_copied += fe.record_len
                await throttle.spent(fe.record_len)
        finally:
            if seg is not None:
                seg.release()
        records, _ = await self._run(self._index.live_of, tenant, sid)
        if records:
            report.errors.append(f"{tenant}/{sid:016x}: {records} live records could not be moved")
            return False
        report.segments_rewritten += 1
        return True

    async def carry_tombstones(self, tenant: str, sid: int) -> int:
        """Before sealed segment ``sid`` goes without being compacted (an
        ephemeral segment dropped under disk pressure), copy forward the
        tombstones in it that an older segment may still need: otherwise an
        index rebuild would bring back blocks the client deleted. Returns
        how many were copied."""
        seg = await self._run(self._cache.acquire, (tenant, sid))
        if seg is None:
            return 0
        copied = 0
        try:
            app = self._appender(tenant)
            entries = await self._residency.read_footer(tenant, sid, seg)
            needed = await self._run(self._tombstones_needed, tenant, sid, entries)
            for fe in entries:
                if fe.offset not in needed:
                    continue
                raw = await self._residency.read_record(tenant, sid, seg, fe.offset, fe.record_len)
                record = await self._run(_checked_record, raw, tenant, fe, f"{tenant}/{sid:016x}.seg")
                copied += await app.copy(record, None)  # KeyReserved: the drop waits for the plan
            if copied:
                await app.make_durable()
        finally:
            seg.release()
        return copied

    def _tombstones_needed(self, tenant: str, sid: int, entries: list[FooterEntry]) -> set[int]:
        """Offsets of the tombstones of segment ``sid`` that must outlive it:
        the key is still absent (not written again since), and the record it
        deleted may still be somewhere an index rebuild would find it: its
        segment can still be replayed (a tombstone names it, see format.py),
        or the tombstone does not say and any older segment can, or an older
        retired segment's object is still in the tier."""
        segs = self._index.segments(tenant)

        def findable(other: int) -> bool:
            """Whether an index rebuild could still replay segment ``other``:
            a live segment, or a retired one whose object is still in the tier
            (a retired one's local file is removed as it is retired, and by
            recovery, before any replay)."""
            st = segs.get(other)
            if st is None or other == sid:
                return False
            if st.state != SEG_RETIRED:
                return True
            ts = self._index.tier_state(tenant, other)
            return ts is not None and ts.mirrored

        older = [other for other in segs if other < sid and findable(other)]
        # A compaction cut short can leave a record in a retired segment's
        # object as well as in its copy: while such objects remain, keep all.
        retired_in_tier = any(segs[other].state == SEG_RETIRED for other in older)
        out = set()
        for fe in entries:
            if fe.kind != KIND_TOMBSTONE or self._index.get(tenant, fe.key) is not None:
                continue
            target = fe.logical_size  # the segment it deleted from (0: not recorded)
            if retired_in_tier or (findable(target) if target else bool(older)):
                out.add(fe.offset)
        return out

    def _worth_it(self, tenant: str, sid: int, entries: list[FooterEntry], needed: set[int], threshold: int) -> bool:
        """Whether rewriting gives back ``threshold`` percent of the segment
        once the tombstones that must stay count as live."""
        st = self._index.segment(tenant, sid)
        total = (st.indexed_upto - ALIGN) if st is not None else 0
        live = self._index.live_of(tenant, sid)[1]
        keep = live + sum(fe.record_len for fe in entries if fe.offset in needed)
        return total > 0 and (total - keep) * 100 >= threshold * total

    # -- retiring and reaping -----------------------------------------------------

    async def _retire(self, tenant: str, segments: list[tuple[int, int]], report: CompactionReport) -> None:
        """Retire each (segment, ``wait_upto``) whose copies are durable, the
        index synced once, then remove their local files (those no lease holds)."""
        done = []
        for sid, wait_upto in segments:
            try:
                await self._run(self._life.retired, tenant, sid, wait_upto)
            except LifecycleError as e:  # written to meanwhile? never for a sealed one; be safe
                report.errors.append(str(e))
                continue
            done.append(sid)
        if not done:
            return
        await self._run(self._index.sync)
        self._metrics.inc("kvstore_compaction_retired_total", len(done))
        for sid in done:
            if not self._leases.held((tenant, sid)):  # else reap() removes it once the lease ends
                report.bytes_reclaimed += await self._run(self._remove_local, tenant, sid)

    async def reap(self, report: CompactionReport, tenant: str | None = None) -> None:
        """Remove what retired segments leave: local files (when no lease
        holds them) and object-tier copies (once the copies are mirrored)."""
        for name in [tenant] if tenant is not None else self._registry.names():
            if name not in self._registry:
                continue
            segs = await self._run(self._index.segments, name)
            mirrored: dict[int, bool] = {}  # wait_upto -> whether the copies up to it are mirrored (this pass)
            for sid, st in sorted(segs.items()):
                if st.state != SEG_RETIRED or self._leases.held((name, sid)):
                    continue
                report.bytes_reclaimed += await self._run(self._remove_local, name, sid)
                ts = await self._run(self._index.tier_state, name, sid)
                if ts is not None and ts.mirrored:
                    if self._residency.tier is None:
                        continue
                    if st.wait_upto not in mirrored:
                        mirrored[st.wait_upto] = await self._run(self._copies_mirrored, name, st.wait_upto)
                    if not mirrored[st.wait_upto]:
                        continue
                    try:
                        await self._residency.delete_object(name, sid)
                    except TierError as e:
                        log.warning("deleting the object of retired segment %s/%016x failed: %s", name, sid, e)
                        continue
                    report.objects_deleted += 1
                await self._run(self._life.deleted, name, sid)

    def _remove_local(self, tenant: str, sid: int) -> int:
        path = self._cache.path(tenant, sid)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return 0
        self._cache.forget((tenant, sid), unlink=True)
        return size

    def _copies_mirrored(self, tenant: str, wait_upto: int) -> bool:
        segs = self._index.segments(tenant)
        for sid, st in segs.items():
            if sid > wait_upto or st.state == SEG_RETIRED:
                continue
            if st.state == SEG_OPEN:
                if st.indexed_upto > ALIGN:
                    return False  # records not sealed yet
                continue
            if self._life.phase(tenant, sid) not in (Phase.MIRRORED, Phase.REMOTE_ONLY):
                return False
        return True


def _checked_record(raw: bytes | bytearray, tenant: str, fe: FooterEntry, where: str) -> EncodedRecord:
    """The record as stored, checked before it is copied: its header, that it
    is the record the footer names, and every frame's checksum. A corrupt
    record is never copied (its segment stays, and reads of it keep failing
    loudly)."""
    view = memoryview(raw)
    h = decode_record_header(view, where, fe.offset)
    if h.tenant != tenant or h.key != fe.key or h.record_id != fe.record_id or h.record_len != len(raw):
        raise CorruptionError(f"record of key {fe.key!r} is not the one the footer names", where, fe.offset)
    pos = h.payload_offset
    for i, f in enumerate(h.frames):
        if checksum(view[pos : pos + f.stored_len]) != f.checksum:
            raise CorruptionError(f"frame {i} of key {fe.key!r} fails its checksum", where, fe.offset)
        pos += f.stored_len
    return EncodedRecord(h, [raw])


__all__ = ["CompactionReport", "Compactor"]


def _fits(live_bytes: int, room: int) -> bool:
    """Whether copying ``live_bytes`` leaves a MiB of ``room`` (records, padding, a seal)."""
    return live_bytes + (1 << 20) <= room
