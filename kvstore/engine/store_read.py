"""The read path of the store: index lookups, local and remote reads, ranges.

A read looks the key up in the index (on the event loop: an LMDB read of a
memory map), then reads and checks the record on the thread pool, decoding
big blocks' frames in parallel. If the block moved while it was read
(compaction) the read asks the index again; if it went, it is a miss.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from typing import TypeVar

from kvstore.engine import reader, verified
from kvstore.engine.access import now_ms
from kvstore.engine.decoded import TENANT_SHARE as DECODED_SHARE
from kvstore.engine.index import IndexEntry
from kvstore.engine.lifecycle import Lease, SegmentKey
from kvstore.engine.registry import Tenant
from kvstore.engine.segment import SegmentFile
from kvstore.engine.store_core import StoreCore
from kvstore.engine.types import BlockInfo, DirectExtent, LookupResult, PlannedBlock, StoredRecord, TenantStats
from kvstore.errors import (
    CorruptionError,
    InvalidInput,
    InvalidKey,
    InvalidRange,
    KVStoreError,
    NotFound,
    NotPlannable,
    SegmentMoved,
    TenantKeyDestroyed,
)
from kvstore.names import all_keys_valid, validate_key

log = logging.getLogger("kvstore.engine.store")
# Index reads run on the event loop: an LMDB read is a lookup in a memory map
# under an MVCC snapshot (it never waits for the writer), ~0.3 us a key here,
# far cheaper than the hop to a thread (~100-200 us under load). Chains longer
# than this still go to the pool, so no single call holds the loop for long.
INLINE_LOOKUP_KEYS = 1024
INLINE_PRESENT_KEYS = 64
T = TypeVar("T")
# Direct reads up to this size have their frames verified on the event loop.
INLINE_VERIFY_BYTES = 4 << 20
READ_ATTEMPTS = 4  # a block that keeps moving under a read (compaction) is retried this often


class StoreReads(StoreCore):
    def _live(self, t: Tenant, key: str, now: int | None = None) -> IndexEntry | None:
        """``key``'s index entry if the block is present and unexpired: the
        one place a read decides that (every read, lookup and listing)."""
        entry = self._index.get(t.name, key)
        if entry is None or (t.ttl_s and self._retention.expired(t, key, entry, now)):
            return None
        return entry

    def _entry(self, tenant: str, key: str) -> IndexEntry:
        """``key``'s live entry, counted as a hit (its access touched), or
        NotFound, counted as a miss: every read of a block starts here, once."""
        t = self._tenant(tenant)
        validate_key(key)
        entry = self._live(t, key)
        if entry is None:
            self.metrics.inc("kvstore_lookups_total", result="miss")
            self.metrics.inc("kvstore_tenant_reads_total", tenant=tenant, result="miss")
            raise NotFound(f"key {key!r} not found")
        self.metrics.inc("kvstore_lookups_total", result="hit")
        self.metrics.inc("kvstore_tenant_reads_total", tenant=tenant, result="hit")
        self.access.touch(tenant, key)
        return entry

    # -- a block read: resolve (now), then what can be sent now or completed --

    def resolve(self, tenant: str, key: str) -> BlockInfo:
        """A block read's first step, on the calling thread (an LMDB read,
        never I/O): the block's head if it is present and unexpired, counted
        as a hit, else NotFound, counted as a miss. What follows it takes the
        result, so a read is looked up, checked for expiry and counted once,
        whichever path finishes it: :meth:`sendable_now` for what needs no
        I/O, :meth:`get_sendable` for the rest."""
        return BlockInfo.of(key, self._entry(tenant, key))

    def sendable_now(self, tenant: str, info: BlockInfo, start: int, end: int) -> DirectExtent | memoryview | None:
        """Bytes [start, end) of a resolved block if they can be sent without
        awaiting anything: a direct block's extent of a segment open here,
        its covering frames verified (verified.py) or cheap to verify here
        (the caller releases it once sent), or a sealed or compressed
        block's plaintext from the decoded-blocks cache. None, with nothing
        held or counted, when the read needs I/O: then :meth:`get_sendable`
        with the same ``info`` completes it."""
        return None if info.entry is None else self._sendable_now(tenant, info.key, info.entry, start, end)

    def _sendable_now(
        self, tenant: str, key: str, entry: IndexEntry, start: int, end: int
    ) -> DirectExtent | memoryview | None:
        if not entry.flags & reader.REC_FLAG_DIRECT:
            generation = self._decodable(tenant, entry)
            cached = (
                None if generation is None else self.decoded.get(tenant, generation, entry.record_id, count_miss=False)
            )
            if cached is None:
                return None
            self.metrics.inc("kvstore_bytes_out_total", end - start)
            return memoryview(cached).toreadonly()[start:end]
        seg = self._residency.local_now(tenant, entry)
        if seg is None:
            return None
        try:
            if end - start > INLINE_VERIFY_BYTES:  # only if verified already: hashing it would hold the loop
                h = verified.header_of(seg, entry.offset)
                if h is None or verified.unverified(
                    seg, entry.offset, start // h.frame_size, (end - 1) // h.frame_size
                ):
                    seg.release()
                    return None
            view = reader.direct_view(seg, entry, tenant, key, start, end)
        except CorruptionError:
            seg.release()
            return None  # reported by the read that completes it
        except BaseException:
            seg.release()
            raise
        self.metrics.inc("kvstore_bytes_out_total", end - start)
        return DirectExtent(seg, entry.offset + entry.payload_offset + start, view)

    async def get(self, tenant: str, key: str) -> bytearray:
        entry = self._entry(tenant, key)
        return _owned(await self._read(tenant, key, entry, 0, entry.logical_size))

    async def get_buffer(self, tenant: str, key: str, start: int = 0, end: int | None = None) -> bytearray | memoryview:
        """Bytes [start, end) of the block (all of it by default), to send on:
        for direct tenants a read-only view into the segment's mapping, the
        covering frames verified (no copy, no allocation); otherwise decoded
        bytes, as :meth:`get_range`."""
        entry, start, end = await self._range(tenant, key, start, end)
        return await self._read(tenant, key, entry, start, end, view_ok=True)

    async def get_sendable(
        self, tenant: str, key: str, start: int = 0, end: int | None = None, info: BlockInfo | None = None
    ) -> DirectExtent | bytearray | memoryview:
        """Bytes [start, end) of the block, to send on: for a direct block in
        a local segment, a :class:`DirectExtent` (the covering frames
        verified; the caller releases it once sent); otherwise as
        :meth:`get_buffer`. ``info``: the block's :meth:`resolve` in the same
        request, so the index is not asked twice (if the block moved or went
        since, the read finds out and asks again, as it always does). The
        read's completion: what :meth:`sendable_now` can send, it sends;
        the rest awaits a segment, a thread or the object tier."""
        entry, start, end = await self._range(tenant, key, start, end, info)
        now = self._sendable_now(tenant, key, entry, start, end)
        if now is not None:
            return now
        if entry.flags & reader.REC_FLAG_DIRECT:
            try:
                seg = await self._residency.local(tenant, entry, key)
            except SegmentMoved:
                seg = None  # the read below asks the index again
            if seg is not None:
                try:
                    if end - start <= INLINE_VERIFY_BYTES:
                        # The covering frames' checksums over the segment's mapping
                        # (xxh3: ~20 us a MiB): cheaper here than the hop to a
                        # thread (~150 us under load). Cold pages block this loop
                        # for their disk read, as nginx's sendfile blocks its worker.
                        view = reader.direct_view(seg, entry, tenant, key, start, end)
                    else:
                        view = await self._run(reader.direct_view, seg, entry, tenant, key, start, end)
                except BaseException as e:
                    seg.release()
                    if not isinstance(e, CorruptionError):
                        raise
                    # Reported (or found stale) by the ordinary read below.
                else:
                    self.metrics.inc("kvstore_bytes_out_total", end - start)
                    return DirectExtent(seg, entry.offset + entry.payload_offset + start, view)
        return await self._read(tenant, key, entry, start, end, view_ok=True)

    async def plan_reads(self, tenant: str, keys: Sequence[str]) -> list[PlannedBlock | KVStoreError]:
        """For each key, where its bytes are (a :class:`PlannedBlock`, whose
        segment the caller releases), or why the client must GET it. The
        records' headers are read in one trip to the thread pool."""
        t = self._tenant(tenant)
        out: list[PlannedBlock | KVStoreError | tuple[IndexEntry, SegmentFile]] = []
        for key in keys:
            try:
                out.append(await self._locate(t, key))
            except (NotFound, NotPlannable, InvalidKey) as e:
                out.append(e)

        def headers() -> list[PlannedBlock | KVStoreError]:
            done: list[PlannedBlock | KVStoreError] = []
            for key, item in zip(keys, out, strict=True):
                if not isinstance(item, tuple):
                    done.append(item)
                    continue
                entry, seg = item
                file = (t.name, t.created_ns, entry.segment_id)
                try:
                    if entry.flags & reader.REC_FLAG_DIRECT:
                        h = reader.direct_header(seg, entry, t.name, key)
                        offset, record = entry.offset + entry.payload_offset, None
                    else:
                        record = reader.stored_frames(seg, entry, t.name, key, 0, entry.logical_size, self._registry)
                        h, offset = record.header, record.offset
                except (CorruptionError, TenantKeyDestroyed) as e:
                    seg.release()
                    done.append(e)
                    continue
                checksums = tuple(f.checksum for f in h.frames)
                done.append(PlannedBlock(key, seg, file, offset, entry.logical_size, h.frame_size, checksums, record))
            return done

        try:
            planned = await self._run(headers)
        except BaseException:
            for item in out:
                if isinstance(item, tuple):
                    item[1].release()
            raise
        self.metrics.inc("kvstore_bytes_out_total", sum(p.size for p in planned if isinstance(p, PlannedBlock)))
        return planned

    def lifecycle_epoch(self) -> int:
        """A counter that moves whenever a segment changes state (an LMDB read)."""
        return self._index.epoch()

    def segment_alive(self, tenant: str, incarnation: int, sid: int) -> bool:
        """Whether a segment a read plan handed out still has its local file
        (not compacted, dropped or deleted; its tenant not created again)."""
        if tenant not in self._registry or self._registry.get(tenant).created_ns != incarnation:
            return False
        return self._life.phase(tenant, sid).local

    async def _locate(self, t: Tenant, key: str) -> tuple[IndexEntry, SegmentFile]:
        """The index entry of a block and its local segment, acquired."""
        entry = self._entry(t.name, key)
        try:
            seg = await self._residency.local(t.name, entry, key)
        except SegmentMoved:
            raise NotPlannable(f"key {key!r} moved while it was planned: GET it") from None
        if seg is None:
            raise NotPlannable(f"key {key!r} is in the object tier only: GET it")
        return entry, seg

    async def get_range(self, tenant: str, key: str, start: int, end: int | None = None) -> bytearray:
        """Bytes [start, end) of the block; ``end`` past the size is clamped.
        Raises InvalidRange (416) when ``start`` is at or past the size."""
        entry, start, end = await self._range(tenant, key, start, end)
        return _owned(await self._read(tenant, key, entry, start, end))

    async def _range(
        self, tenant: str, key: str, start: int, end: int | None, info: BlockInfo | None = None
    ) -> tuple[IndexEntry, int, int]:
        if start < 0 or (end is not None and end <= start):
            raise InvalidInput(f"range [{start}, {end}) is not a non-empty range of non-negative offsets")
        entry = info.entry if info is not None and info.entry is not None else self._entry(tenant, key)
        size = entry.logical_size
        if start >= size:
            raise InvalidRange(f"range starts at {start}, past the end of a {size}-byte block", size)
        return entry, start, size if end is None else min(end, size)

    async def _read(
        self, tenant: str, key: str, entry: IndexEntry, start: int, end: int, view_ok: bool = False
    ) -> bytearray | memoryview:
        return await self._retrying(
            tenant, key, entry, lambda e: self._read_unchecked(tenant, key, e, start, end, view_ok)
        )

    async def _retrying(
        self, tenant: str, key: str, entry: IndexEntry, attempt: Callable[[IndexEntry], Awaitable[T]]
    ) -> T:
        """``attempt(entry)``, again with the index's fresh entry while the
        block moves under it; a corrupt record is counted and logged."""
        try:
            for _ in range(READ_ATTEMPTS - 1):
                try:
                    return await attempt(entry)
                except SegmentMoved:
                    # Compaction moved the block, or eviction dropped it, while
                    # it was being read: ask the index again.
                    fresh = self._index.get(tenant, key)
                    if fresh is None:
                        raise NotFound(f"key {key!r} not found") from None
                    if fresh.record_id != entry.record_id:  # deleted and written again: other bytes
                        raise
                    entry = fresh
            return await attempt(entry)
        except TenantKeyDestroyed:
            raise
        except CorruptionError as e:
            if self._index.get(tenant, key) != entry:
                # The block went (its tenant deleted and created again, say)
                # while it was read: what was read belongs to someone else.
                raise NotFound(f"key {key!r} not found") from None
            self.metrics.inc("kvstore_corruption_total")
            log.error("corrupt read of tenant %s: %s", tenant, e)
            raise

    async def get_stored(self, tenant: str, key: str, start: int = 0, end: int | None = None) -> StoredRecord:
        """The stored frames that cover bytes [start, end) of the block, as
        they are, with what opens them (for a client that decodes the record
        itself); the caller releases the answer once it is sent."""
        entry, start, end = await self._range(tenant, key, start, end)
        return await self._retrying(tenant, key, entry, lambda e: self._stored_unchecked(tenant, key, e, start, end))

    async def _stored_unchecked(self, tenant: str, key: str, entry: IndexEntry, start: int, end: int) -> StoredRecord:
        seg = await self._residency.local(tenant, entry, key)
        if seg is None:
            source = await self._residency.fetch(tenant, key, entry)
            frames = await self._run(reader.stored_frames, source, entry, tenant, key, start, end, self._registry)
            body: DirectExtent | memoryview = frames.view
        else:
            try:
                # A header from the segment's mapping and one HKDF: cheaper here than a thread hop.
                frames = reader.stored_frames(seg, entry, tenant, key, start, end, self._registry)
            except BaseException:
                seg.release()
                raise
            body = DirectExtent(seg, frames.offset, frames.view)
        self.metrics.inc("kvstore_bytes_out_total", end - start)
        return StoredRecord(start, end, frames, body)

    async def _read_unchecked(
        self, tenant: str, key: str, entry: IndexEntry, start: int, end: int, view_ok: bool
    ) -> bytearray | memoryview:
        generation = self._decodable(tenant, entry)
        if generation is not None:  # the decoded-blocks cache (decoded.py): the whole block
            cached = self.decoded.get(tenant, generation, entry.record_id)
            if cached is not None:
                self.metrics.inc("kvstore_bytes_out_total", end - start)
                return memoryview(cached).toreadonly()[start:end]
            lo, hi = 0, entry.logical_size
        else:
            lo, hi = start, end
        try:
            out = await self._read_span(tenant, key, entry, lo, hi, view_ok)
        except CorruptionError:
            if generation is None:
                raise
            # A damaged frame outside [start, end) must not fail this read: only
            # the range is decoded (and nothing cached), as without the cache.
            generation = None
            out = await self._read_span(tenant, key, entry, start, end, view_ok)
        if generation is not None:
            self.decoded.put(tenant, generation, entry.record_id, out)
            out = memoryview(out).toreadonly()[start:end]  # never the cached buffer itself: a view or a copy
        self.metrics.inc("kvstore_bytes_out_total", end - start)
        return out

    async def _read_span(
        self, tenant: str, key: str, entry: IndexEntry, start: int, end: int, view_ok: bool
    ) -> bytearray | memoryview:
        seg = await self._residency.local(tenant, entry, key)
        if seg is None:
            source = await self._residency.fetch(tenant, key, entry)
            return await self._decode(source, tenant, key, entry, start, end)
        try:
            return await self._read_local(seg, tenant, key, entry, start, end, view_ok)
        finally:
            seg.release()

    def _decodable(self, tenant: str, entry: IndexEntry) -> tuple[int, int] | None:
        """The tenant's generation for the decoded-blocks cache if this
        block's reads go through it (not direct, not too big), else None."""
        if entry.flags & reader.REC_FLAG_DIRECT or not self.decoded.enabled:
            return None
        if entry.logical_size > self.decoded.capacity * DECODED_SHARE:
            return None
        t = self._tenant(tenant)
        return (t.created_ns, t.key_version)

    async def _read_local(
        self, seg: SegmentFile, tenant: str, key: str, entry: IndexEntry, start: int, end: int, view_ok: bool
    ) -> bytearray | memoryview:
        direct = bool(entry.flags & reader.REC_FLAG_DIRECT)
        if direct and view_ok:
            return await self._run(reader.direct_view, seg, entry, tenant, key, start, end)
        if direct and start == 0 and end == entry.logical_size:
            return await self._run(reader.read_direct_whole, seg, entry, tenant, key)
        return await self._decode(seg, tenant, key, entry, start, end)

    async def _decode(
        self, source: reader.RecordSource, tenant: str, key: str, entry: IndexEntry, start: int, end: int
    ) -> bytearray:
        if end - start <= self.config.frame_size:
            return await self._run(reader.read_all_inline, source, entry, tenant, key, start, end, self._registry)
        ld = await self._run(reader.load, source, entry, tenant, key, start, end, self._registry)
        out = bytearray(end - start)
        view = memoryview(out)
        await asyncio.gather(
            *(self._run(reader.decode_into, ld, i, start, end, view) for i in range(ld.first, ld.last + 1))
        )
        return out

    async def head(self, tenant: str, key: str) -> BlockInfo:
        return self.resolve(tenant, key)

    async def exists(self, tenant: str, key: str) -> bool:
        return self.holds(tenant, key)

    def holds(self, tenant: str, key: str) -> bool:
        """Whether the block is present and unexpired, on the calling thread,
        counting nothing (the store's own bookkeeping, a takeover's lookups)."""
        t = self._tenant(tenant)
        validate_key(key)
        return self._live(t, key) is not None

    async def lookup(self, tenant: str, keys: Sequence[str], tokens_per_block: int = 0) -> LookupResult:
        """Which of a chain of keys are present, and how many from the start
        (``tokens_per_block``: the engine's, for the hit rate in tokens)."""
        now = self.lookup_now(tenant, keys, tokens_per_block)
        if now is not None:
            return now
        t = self._tenant(tenant)
        _validate_keys(keys)
        if t.ttl_s:
            present = await self._run(self._present_unexpired, t, list(keys))
        else:
            present = await self._run(self._index.contains, tenant, list(keys))
        return self._looked_up(tenant, present, tokens_per_block)

    def lookup_now(self, tenant: str, keys: Sequence[str], tokens_per_block: int = 0) -> LookupResult | None:
        """A lookup's first step, on the calling thread, when it needs nothing
        more than the index (no TTL to check, at most INLINE_LOOKUP_KEYS
        keys); None, counting nothing, otherwise: then :meth:`lookup`
        completes it on a thread. Raises as :meth:`lookup`."""
        t = self._tenant(tenant)
        if t.ttl_s or len(keys) > INLINE_LOOKUP_KEYS:
            return None
        _validate_keys(keys)
        return self._looked_up(tenant, self._index.contains(tenant, list(keys)), tokens_per_block)

    def _looked_up(self, tenant: str, present: list[bool], tokens_per_block: int) -> LookupResult:
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        # The engines' hit rate, in blocks: of the chain asked for, how much is here from its start
        # (the node's, and each tenant's: the admin's tenant list shows it).
        self.metrics.inc("kvstore_prefix_lookups_total")
        self.metrics.inc("kvstore_prefix_blocks_total", prefix, result="hit")
        self.metrics.inc("kvstore_prefix_blocks_total", len(present) - prefix, result="miss")
        self.metrics.inc("kvstore_tenant_prefix_blocks_total", prefix, tenant=tenant, result="hit")
        self.metrics.inc("kvstore_tenant_prefix_blocks_total", len(present) - prefix, tenant=tenant, result="miss")
        if tokens_per_block:
            self.metrics.inc("kvstore_prefix_tokens_total", prefix * tokens_per_block, result="hit")
            self.metrics.inc("kvstore_prefix_tokens_total", (len(present) - prefix) * tokens_per_block, result="miss")
        return LookupResult(prefix, present)

    async def lookup_locked(
        self, tenant: str, keys: Sequence[str], lease_s: float, tokens_per_block: int = 0
    ) -> tuple[LookupResult, Lease | None]:
        """:meth:`lookup`, with the present keys locked: pinned under one
        lease the tenant owns (neither evicted for its quota nor expired
        while it holds; their segments neither compacted nor dropped) and
        touched, as a read would. None when no key is present. The lookup
        runs before the pin (a pin would keep an expired block a hit), so a
        key a removal took in between is answered absent (:meth:`lock`)."""
        r = await self.lookup(tenant, keys, tokens_per_block)
        hits = [k for k, p in zip(keys, r.present, strict=True) if p]
        if not hits:
            return r, None
        lease = await self.lock(uuid.uuid4().hex, tenant, hits, lease_s)
        locked = {k for _, k in lease.blocks} if lease is not None else set()
        for k in locked:
            self.access.touch(tenant, k)
        return (r if len(locked) == len(hits) else r.only(keys, locked)), lease

    async def lock(
        self, lease_id: str, tenant: str, keys: Sequence[str], lease_s: float, segments: Iterable[SegmentKey] = ()
    ) -> Lease | None:
        """Lock those of ``keys`` still indexed, under lease ``lease_id``
        owned by ``tenant``, with their segments (and ``segments``); None,
        and nothing held, when none is (a writer takes a reader's lock so)."""
        return await self._run(self._lock_found, lease_id, tenant, list(keys), lease_s, list(segments))

    def _lock_found(
        self, lease_id: str, tenant: str, keys: list[str], lease_s: float, segments: list[SegmentKey]
    ) -> Lease | None:
        """(On an executor thread: a pin may wait for a removal.) All keys are
        pinned before the index is read: a removal that checked the pins
        earlier has committed by then (the key is absent here), a later one
        spares the key (Leases.sparing)."""
        self.leases.acquire(segments, lease_s, lease_id, tenant, [(tenant, k) for k in keys])
        try:
            found = {k: e for k in keys if (e := self._index.get(tenant, k)) is not None}
        except BaseException:
            self.leases.release(lease_id)
            raise
        if not found:
            self.leases.release(lease_id)
            return None
        held = {(tenant, e.segment_id) for e in found.values()} | set(segments)
        return self.leases.acquire(held, lease_s, lease_id, tenant, [(tenant, k) for k in found])

    async def narrow_lock(self, lease: Lease, kept: Collection[str], lease_s: float) -> Lease | None:
        """A reader's lock narrowed to the keys the writer could lock too
        (``kept``); None, and released, when it could lock none."""
        if not kept:
            self.leases.release(lease.id)
            return None
        blocks = [(t, k) for t, k in lease.blocks if k in kept]
        return await self._run(self.leases.acquire, lease.segments, lease_s, lease.id, lease.owner, blocks)

    async def present(self, tenant: str, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` are present (and unexpired), without counting a
        lookup or touching them: for the store's own bookkeeping."""
        t = self._tenant(tenant)
        if len(keys) <= INLINE_PRESENT_KEYS:  # a few index reads: cheaper here than the hop to a thread
            return self._present_unexpired(t, list(keys)) if t.ttl_s else self._index.contains(tenant, list(keys))
        if t.ttl_s:
            return await self._run(self._present_unexpired, t, list(keys))
        return await self._run(self._index.contains, tenant, list(keys))

    def _present_unexpired(self, t: Tenant, keys: list[str]) -> list[bool]:
        now = now_ms()
        return [self._live(t, k, now) is not None for k in keys]

    async def list_keys(
        self, tenant: str, prefix: str = "", start_after: str | None = None, limit: int = 1000
    ) -> tuple[list[tuple[str, int]], str | None]:
        """A page of the tenant's keys starting with ``prefix``, in byte
        order after ``start_after``, with their sizes (expired ones left
        out); and where the next page starts (None: this was the last)."""
        t = self._tenant(tenant)
        page = await self._run(self._index.entries, tenant, start_after, limit, prefix)
        items = [(k, e.logical_size) for k, e in page]
        if t.ttl_s:
            now = now_ms()
            items = [
                (k, n) for (k, n), (_, e) in zip(items, page, strict=True) if not self._retention.expired(t, k, e, now)
            ]
        return items, (page[-1][0] if len(page) == limit else None)

    async def iter_keys(self, tenant: str, start_after: str | None = None, page: int = 1000) -> AsyncIterator[str]:
        """Every key of the tenant, in byte order, a page of the index at a time."""
        self._tenant(tenant)
        while True:
            keys = await self._run(self._index.keys, tenant, start_after, page)
            for k in keys:
                yield k
            if len(keys) < page:
                return
            start_after = keys[-1]

    async def stats(self, tenant: str) -> TenantStats:
        self._tenant(tenant)
        s = self._index.stats(tenant)
        return TenantStats(s.blocks, s.stored_bytes, s.logical_bytes)


def _validate_keys(keys: Sequence[str]) -> None:
    if all_keys_valid(keys):
        return
    for i, k in enumerate(keys):
        try:
            validate_key(k)
        except InvalidKey as e:
            raise InvalidKey(f"keys[{i}]: {e}") from None


def _owned(data: bytearray | memoryview) -> bytearray:
    """A buffer the caller owns (reads without ``view_ok`` already are)."""
    return data if isinstance(data, bytearray) else bytearray(data)
