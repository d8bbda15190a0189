"""Residency: where a segment's data lives (G3, G4 or both), what is
uploaded, what is dropped under disk pressure, and what is brought back.

One :class:`Residency` per open store answers "where are this segment's
bytes" for every reader of them (the read path, compaction), in one place:
its local file (:meth:`Residency.local`), else its object in the tier
(:meth:`Residency.fetch`, :meth:`Residency.read_footer`,
:meth:`Residency.read_record`). In the process that owns the store it runs
the mirror (mirror.py), the evictor (space.py's policy), rehydration and the
space reserve's refills; in a reader worker (``writer=False``) it only
routes reads, learning from the index which segments another process has
dropped. What it needs of the rest of the engine (an appender's removals,
tombstones carried forward, residency events, compaction woken) it asks
through one :class:`ResidencyHooks`.

Wiring order (store.py): the residency is built first, then what its hooks
call (the compactor), then :meth:`Residency.start` starts its tasks, so
nothing runs before what it calls exists.

Reads of a segment with no local copy fetch just the record with one ranged
GET (remote.py). They fail fast with a retryable error (503
``tier_unavailable``) when the tier cannot answer within
``s3_read_timeout_ms``, and for a second after that without trying, so a dead
endpoint does not hold every read for the whole timeout.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from kvstore.config import StoreConfig
from kvstore.engine.format import FooterEntry
from kvstore.engine.index import SEG_SEALED, Index, IndexEntry, TierState
from kvstore.engine.layout import REGISTRY_OBJECT, parse_segment_object, segment_object, tenant_prefix
from kvstore.engine.lifecycle import SWEEP_INTERVAL_S, Leases, Lifecycle, LifecycleError, Phase
from kvstore.engine.mirror import Mirror
from kvstore.engine.recovery import RemoteSegments, index_tier_segment
from kvstore.engine.registry import Registry
from kvstore.engine.remote import FetchedRecord, RemoteFooter, download_segment, fetch_footer
from kvstore.engine.reserve import SpaceReserve
from kvstore.engine.segcache import SegmentCache
from kvstore.engine.segment import SegmentFile
from kvstore.engine.space import Candidate, Space
from kvstore.errors import (
    CorruptionError,
    KeyReserved,
    SegmentMoved,
    StorageFull,
    TierError,
    TierNotFound,
    TierRangeError,
    TierUnavailable,
)
from kvstore.events.model import TierName
from kvstore.fsutil import atomic_write
from kvstore.metrics import Metrics
from kvstore.tasks import Background, wait_event
from kvstore.tier.base import Tier

log = logging.getLogger("kvstore.engine.residency")
SegmentKey = tuple[str, int]
EVICT_INTERVAL_S = 2.0
FAIL_FAST_S = 1.0
INDEX_HEADROOM = 1 << 20  # free bytes a put leaves besides its own, for the index's commits


class ResidencyHooks(Protocol):
    """What residency asks of the rest of the engine (the store implements it)."""

    async def drop_segment_entries(self, tenant: str, sid: int) -> int:
        """Remove, through the tenant's appender, every entry pointing into
        sealed segment ``sid`` (an ephemeral segment about to be dropped)."""
        ...

    async def carry_tombstones(self, tenant: str, sid: int) -> int:
        """Copy forward the tombstones of ``sid`` an older segment still
        needs, before ``sid`` goes without being compacted."""
        ...

    async def segment_moved(self, tenant: str, sid: int, to: TierName) -> None:
        """The segment's blocks are now read from ``to`` (residency events)."""
        ...

    def disk_full(self) -> None:
        """A put was refused for space: compaction should run now."""
        ...


class Residency:
    def __init__(
        self,
        config: StoreConfig,
        index: Index,
        registry: Registry,
        cache: SegmentCache,
        lifecycle: Lifecycle,
        leases: Leases,
        metrics: Metrics,
        run: Callable[..., Awaitable[Any]],
        tier: Tier | None,
        hooks: ResidencyHooks | None = None,
        reserve: SpaceReserve | None = None,
        writer: bool = True,
        adopted: bool = False,
    ) -> None:
        """``hooks``: None in a reader worker (it drops nothing); ``reserve``:
        the writer's space reserve (reserve.py)."""
        self._hooks = hooks
        self.reserve = reserve
        self._refused = False  # a put was refused for space since the disk last had room
        self.config = config
        self._life = lifecycle
        self._leases = leases
        self.tier = tier
        self.writer = writer
        self.adopted = adopted
        self.space = Space(
            config.data_dir, config.data_dir / "segments", config.capacity, config.high_watermark, config.low_watermark
        )
        self._index = index
        self._registry = registry
        self._cache = cache
        self._metrics = metrics
        self._run = run
        self._remote_only: set[SegmentKey] = set()
        self._remote_reads: collections.Counter[SegmentKey] = collections.Counter()
        self._rehydrating: set[SegmentKey] = set()
        self._down_until = 0.0
        self._evict_lock = asyncio.Lock()
        self._evict_wake = asyncio.Event()
        self._tasks = Background()
        self.mirror: Mirror | None = None  # when this process uploads

    # -- life cycle -----------------------------------------------------------

    async def start(self, mirror: Mirror | None, background: bool = True) -> None:
        """After recovery: learn which segments are remote only, queue what is
        not mirrored yet, start the evictor."""
        states = await self._run(self._index.tier_states)
        self._remote_only = {k for k, st in states.items() if not st.local}
        self.mirror = mirror
        if mirror is not None:
            mirror.start()
            await self._run(self._queue_unmirrored, states)
        if not background:
            return
        if self.writer:
            self._spawn(self._evictor(), "evictor")
        else:
            self._spawn(self._sweeper(), "segment-sweeper")
        if self.adopted:
            self._spawn(self._follow_bucket(), "follow-bucket")
        await self._run(self.space.rescan)
        await self.refresh_gauges()

    def kick(self) -> None:
        """Run an eviction pass soon (the disk filled)."""
        self._evict_wake.set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` in the background until done or until close."""
        return self._spawn(coro, name)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        return self._tasks.spawn(coro, name)

    async def close(self) -> None:
        await self._tasks.close()
        if self.mirror is not None:
            await self.mirror.close()

    def _queue_unmirrored(self, states: dict[SegmentKey, TierState]) -> None:
        for name in self._registry.names():
            t = self._registry.get(name)
            if t.durability != "persistent":
                continue
            for sid, st in self._index.segments(name).items():
                ts = states.get((name, sid))
                if st.state == SEG_SEALED and (ts is None or not ts.mirrored):
                    self._queue_upload(name, sid)

    def _queue_upload(self, tenant: str, sid: int) -> None:
        path = self._cache.path(tenant, sid)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            log.error("sealed segment %s/%016x is neither local nor mirrored", tenant, sid)
            return
        incarnation = self._registry.get(tenant).created_ns
        assert self.mirror is not None
        self.mirror.enqueue((tenant, sid), path, segment_object(tenant, incarnation, sid), size)

    # -- events from the store ------------------------------------------------

    def sealed(self, tenant: str, sid: int) -> None:
        """On the event loop: a segment of ``tenant`` was sealed."""
        mirror_it = self.mirror is not None and tenant in self._registry
        if mirror_it and self._registry.get(tenant).durability == "persistent":
            self._queue_upload(tenant, sid)
        self._evict_wake.set()

    def mirrored(self, key: SegmentKey) -> None:
        self._evict_wake.set()

    def tenant_deleted(self, tenant: str, incarnation: int) -> None:
        for key in [k for k in self._remote_only if k[0] == tenant]:
            self._remote_only.discard(key)
            self.space.forget(key)
            self._remote_reads.pop(key, None)
        if self.mirror is not None:
            self.mirror.forget_tenant(tenant, tenant_prefix(tenant, incarnation))

    # -- reads ----------------------------------------------------------------

    async def local(self, tenant: str, entry: IndexEntry, key: str) -> SegmentFile | None:
        """The block's segment, acquired (the caller releases it), or None when
        the read must go to the object tier."""
        k = (tenant, entry.segment_id)
        if self._remote_only_now(k):
            return None
        seg = self._cache.acquire_cached(k)
        if seg is None:
            seg = await self._run(self._cache.acquire, k)
        if seg is not None:
            self.space.touch(k)
            return seg
        ts = self._index.tier_state(*k)
        if ts is not None and ts.mirrored:
            return None
        if self._index.get(tenant, key) != entry:
            raise SegmentMoved(f"key {key!r} moved or went while it was read")
        raise CorruptionError("segment file is missing", f"{tenant}/{entry.segment_id:016x}.seg", 0)

    def local_now(self, tenant: str, entry: IndexEntry) -> SegmentFile | None:
        """:meth:`local` when the segment is open in this process already (no
        I/O, nothing awaited); None otherwise (then ask :meth:`local`)."""
        k = (tenant, entry.segment_id)
        if self._remote_only_now(k):
            return None
        seg = self._cache.acquire_cached(k)
        if seg is not None:
            self.space.touch(k)
        return seg

    def _remote_only_now(self, k: SegmentKey) -> bool:
        """Whether the segment's reads go to the object tier now (a reader
        process asks the index what the writer dropped, and lets go of its file)."""
        if self.writer:
            return k in self._remote_only
        ts = self._index.tier_state(*k)
        if ts is not None and not ts.local:
            self._cache.forget(k)
            return True
        return False

    async def fetch(self, tenant: str, key: str, entry: IndexEntry) -> FetchedRecord:
        """The record of ``key`` from the object tier (one ranged GET)."""
        k = (tenant, entry.segment_id)
        if self.tier is None:
            raise CorruptionError(
                "segment has no local copy and no object tier is configured", f"{tenant}/{entry.segment_id:016x}.seg", 0
            )
        if time.monotonic() < self._down_until:
            raise TierUnavailable("the object tier did not answer just now; retry shortly")
        name = segment_object(tenant, self._registry.get(tenant).created_ns, entry.segment_id)
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.s3_read_timeout_ms / 1000):
                data = await self.tier.read_range(name, entry.offset, entry.record_len)
        except TimeoutError:
            self._down(f"no answer in {self.config.s3_read_timeout_ms} ms")
            raise TierUnavailable(f"the object tier did not answer in {self.config.s3_read_timeout_ms} ms") from None
        except TierUnavailable as e:
            self._down(str(e))
            raise
        except (TierNotFound, TierRangeError) as e:
            if self._index.get(tenant, key) != entry:
                raise SegmentMoved(f"key {key!r} moved or went while it was read") from None
            self._metrics.inc("kvstore_tier_errors_total", op="read")
            raise CorruptionError(f"the object tier lacks the record of key {key!r}: {e}", name, entry.offset) from None
        except TierError:
            self._metrics.inc("kvstore_tier_errors_total", op="read")
            raise
        self._metrics.observe("kvstore_tier_read_seconds", time.perf_counter() - t0)
        self._metrics.inc("kvstore_tier_download_bytes_total", len(data))
        self._metrics.inc("kvstore_tier_reads_total")
        self.space.touch(k)
        self._maybe_rehydrate(k)
        return FetchedRecord(data, entry.offset, name)

    def object_of(self, tenant: str, sid: int) -> tuple[str, int]:
        """(name, size) of segment ``sid``'s object in the tier."""
        ts = self._index.tier_state(tenant, sid)
        if ts is None or self.tier is None:
            raise CorruptionError("segment is neither local nor in the object tier", f"{tenant}/{sid:016x}.seg", 0)
        return segment_object(tenant, self._registry.get(tenant).created_ns, sid), ts.size

    async def read_footer(self, tenant: str, sid: int, seg: SegmentFile | None) -> list[FooterEntry]:
        """The footer of sealed segment ``sid``: from ``seg``, its local file
        (acquired by the caller), or from its object in the tier."""
        if seg is not None:
            entries: list[FooterEntry] = await self._run(seg.read_footer)
            return entries
        assert self.tier is not None
        name, size = self.object_of(tenant, sid)
        return (await fetch_footer(self.tier, name, size, tenant, sid)).entries

    async def read_record(
        self, tenant: str, sid: int, seg: SegmentFile | None, offset: int, length: int
    ) -> bytes | bytearray:
        """Bytes [offset, offset + length) of segment ``sid``, as
        :meth:`read_footer` finds it (maintenance: no fail-fast, no rehydration)."""
        if seg is not None:
            data: bytearray = await self._run(seg.pread, offset, length)
            return data
        assert self.tier is not None
        name, _ = self.object_of(tenant, sid)
        return await self.tier.read_range(name, offset, length)

    async def delete_object(self, tenant: str, sid: int) -> None:
        """Delete segment ``sid``'s object from the tier (a retired segment's)."""
        assert self.tier is not None
        await self.tier.delete(segment_object(tenant, self._registry.get(tenant).created_ns, sid))

    def _down(self, why: str) -> None:
        self._metrics.inc("kvstore_tier_errors_total", op="read")
        self._down_until = time.monotonic() + FAIL_FAST_S
        log.warning("object tier read failed: %s", why)

    # -- rehydration ----------------------------------------------------------

    def _maybe_rehydrate(self, k: SegmentKey) -> None:
        n = self.config.rehydrate_reads
        if not self.writer or not n or k in self._rehydrating:
            return
        self._remote_reads[k] += 1
        if self._remote_reads[k] < n:
            return
        ts = self._index.tier_state(*k)
        if ts is None or self.full or self.space.usage().percent(ts.size) > self.config.high_watermark:
            return  # it would only be dropped again (or the disk is full): keep reading it remotely
        if not self._leases.try_claim(k):
            return  # compaction is rewriting it
        self._rehydrating.add(k)
        self._spawn(self._rehydrate(k, ts), f"rehydrate:{k[0]}/{k[1]:x}")

    async def _rehydrate(self, k: SegmentKey, ts: TierState) -> None:
        tenant, sid = k
        assert self.tier is not None
        try:
            name = segment_object(tenant, self._registry.get(tenant).created_ns, sid)
            dest = self._cache.path(tenant, sid)
            await self._run(lambda: dest.parent.mkdir(parents=True, exist_ok=True))
            await download_segment(self.tier, name, ts.size, dest, self._run)
            await self._run(self._life.rehydrated, tenant, sid)
            self._remote_only.discard(k)
            if self._hooks is not None:
                await self._hooks.segment_moved(tenant, sid, "local")
            self.space.wrote(ts.size)
            self._metrics.inc("kvstore_tier_rehydrations_total")
            self._metrics.inc("kvstore_tier_download_bytes_total", ts.size)
            log.info("rehydrated %s/%016x (%d bytes)", tenant, sid, ts.size)
        except (TierError, OSError, CorruptionError, LifecycleError) as e:
            self._metrics.inc("kvstore_tier_errors_total", op="rehydrate")
            log.warning("rehydrating %s/%016x failed: %s", tenant, sid, e)
            if isinstance(e, LifecycleError):
                self._cache.path(tenant, sid).unlink(missing_ok=True)
        finally:
            self._leases.unclaim(k)
            self._rehydrating.discard(k)
            self._remote_reads.pop(k, None)

    # -- space ----------------------------------------------------------------

    @property
    def full(self) -> bool:
        """Whether the disk is full: the space reserve is in use (released
        for removals and maintenance), or a put was refused for space and
        the disk has not had room since. Compaction then runs at once and
        takes what frees the most space for the least copying."""
        return self._refused or (self.reserve is not None and not self.reserve.whole)

    async def admit(self, nbytes: int) -> None:
        """Refuse (507) a write of ``nbytes`` that would not fit even after
        dropping everything droppable, or while the space reserve is in use;
        wake the evictor above the high mark."""
        sp = self.space
        need = nbytes + INDEX_HEADROOM
        reserve = self.reserve
        if (reserve is None or reserve.whole) and sp.fits(need):
            self._refused = False
            if sp.over_high(nbytes):
                self._evict_wake.set()
            return
        await self.evict()
        if reserve is not None and not reserve.whole and not await self._run(reserve.fill):
            self._refuse(
                f"the disk is full: the data directory's filesystem has {await self._run(reserve.available)} bytes "
                f"free and its space reserve ({reserve.size} bytes) is in use by removals and compaction; puts "
                "resume once compaction has freed it (delete blocks, lower quotas or TTLs, or add space)"
            )
        if not sp.fits(need):
            waiting = self.mirror.backlog[0] if self.mirror is not None else 0
            u = sp.usage()
            self._refuse(
                f"the data directory is full ({u.used} of {u.capacity} bytes) and nothing can be dropped: "
                f"persistent data is kept until it is in the object tier ({waiting} segments wait for upload)"
            )
        self._refused = False

    async def _maintain(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a maintenance step that writes (the index); on a full disk,
        with the space reserve released."""
        call = functools.partial(fn, *args)
        return await self._run(call if self.reserve is None else functools.partial(self.reserve.spending, call))

    def _refuse(self, why: str) -> None:
        self.filled()
        raise StorageFull(why)

    def filled(self) -> None:
        """A put was refused for space (here, or ENOSPC while it was written):
        the disk is full until it has room again."""
        self._refused = True
        self._metrics.inc("kvstore_space_refusals_total")
        self._metrics.set("kvstore_space_full", 1)
        if self._hooks is not None:
            self._hooks.disk_full()

    async def relieve(self) -> bool:
        """(The evictor, every pass.) Allocate the space reserve again if it
        was released and there is room; True when the disk has room for puts."""
        reserve = self.reserve
        if reserve is not None and not reserve.whole and not await self._run(reserve.fill):
            return False
        if self._refused and not self.space.fits(INDEX_HEADROOM + (1 << 20)):
            return False
        self._refused = False
        return True

    async def _evictor(self) -> None:
        while True:
            await wait_event(self._evict_wake, EVICT_INTERVAL_S)
            self._evict_wake.clear()
            try:
                await self.evict()
                await self.relieve()
                await self.refresh_gauges()
            except Exception:
                log.exception("eviction pass failed")

    async def evict(self) -> int:
        """One pass: if usage is above the high watermark, drop segments down
        to the low one. Returns how many were dropped."""
        async with self._evict_lock:
            usage = await self._run(self.space.rescan)
            if usage.percent() <= self.config.high_watermark:
                return 0
            candidates = await self._run(self._candidates)
            victims = self.space.victims(candidates, usage)
            dropped = []
            for c in victims:
                if not self._leases.try_claim(c.key):
                    continue  # compaction has it: it will free the space itself
                try:
                    if await self._drop(c):
                        dropped.append(c)
                finally:
                    self._leases.unclaim(c.key)
            victims = dropped
            if victims:
                log.info(
                    "dropped %d segments (%d bytes) under disk pressure", len(victims), sum(c.size for c in victims)
                )
            return len(victims)

    def _candidates(self) -> list[Candidate]:
        states = self._index.tier_states()
        out: list[Candidate] = []
        for name in self._registry.names():
            ephemeral = self._registry.get(name).durability == "ephemeral"
            for sid, st in self._index.segments(name).items():
                ts = states.get((name, sid))
                if st.state != SEG_SEALED or (ts is not None and not ts.local):
                    continue
                mirrored = ts is not None and ts.mirrored
                if not (mirrored or ephemeral):
                    continue  # persistent and not yet in the tier: never dropped
                if self._leases.held((name, sid)):
                    continue  # a reader outside the daemon holds its bytes
                try:
                    size = self._cache.path(name, sid).stat().st_size
                except FileNotFoundError:
                    continue
                out.append(Candidate((name, sid), size, mirrored, self._registry.get(name).created_ns))
        return out

    async def _drop(self, c: Candidate) -> bool:
        """Drop one segment's local copy; False when it changed meanwhile."""
        tenant, sid = c.key
        if tenant not in self._registry or self._registry.get(tenant).created_ns != c.incarnation:
            return False  # deleted (and maybe created again) since it was chosen
        phase = await self._run(self._life.phase, tenant, sid)
        if c.mirrored:
            if phase is not Phase.MIRRORED:
                return False
            await self._maintain(self._life.dropped, tenant, sid)
            self._remote_only.add(c.key)
            if self._hooks is not None:
                await self._hooks.segment_moved(tenant, sid, "object")
            kind = "mirrored"
        else:
            if phase is not Phase.SEALED or self._hooks is None:
                return False
            try:
                await self._hooks.carry_tombstones(tenant, sid)  # those an older segment needs
            except KeyReserved:
                return False  # a write plan holds a key it deletes: dropped later
            await self._hooks.drop_segment_entries(tenant, sid)  # through the tenant's appender
            # Retired, not forgotten, until its file is gone: recovery removes
            # a retired segment's file, where it would index a forgotten one
            # from its footer and bring its blocks back.
            await self._maintain(self._life.retired, tenant, sid)
            kind = "ephemeral"
        await self._run(self._index.sync)  # the state is durable before the file goes
        await self._run(self._cache.forget, c.key, True)
        if not c.mirrored:
            await self._maintain(self._life.deleted, tenant, sid)
        self.space.removed(c.size)
        self.space.forget(c.key)
        self._metrics.inc("kvstore_evictions_total", kind=kind)
        self._metrics.inc("kvstore_evicted_bytes_total", c.size, kind=kind)
        return True

    # -- a reader process: let go of files the writer removed ----------------

    async def _sweeper(self) -> None:
        seen = -1
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                epoch = await self._run(self._index.epoch)
                if epoch != seen:
                    await self._run(self.sweep)
                    seen = epoch
            except Exception:
                log.exception("segment sweep failed")

    def sweep(self) -> int:
        """Close this process's files of segments that are no longer local and
        alive (dropped, retired, deleted); returns how many. The files kept
        check their frames again (the epoch also moves when a scrub found
        damage: verified.py)."""
        gone = [k for k in self._cache.segment_keys() if not self._life.phase(*k).local]
        for k in gone:
            self._cache.forget(k)
        self._cache.forget_verified()
        return len(gone)

    async def refresh_gauges(self) -> None:
        """Tier and disk gauges; local segment counts are the last rescan's.
        (The mirror keeps the upload backlog gauges itself.)"""
        states = await self._run(self._index.tier_states)
        u = self.space.usage()
        m = self._metrics
        m.set("kvstore_disk_used_bytes", u.used)
        m.set("kvstore_disk_capacity_bytes", u.capacity)
        m.set("kvstore_space_full", int(self.full))
        if self.reserve is not None:
            m.set("kvstore_space_reserve_bytes", self.reserve.held)
            m.set("kvstore_space_reserve_target_bytes", self.reserve.size)
            m.set("kvstore_space_reserve_releases", self.reserve.releases)
        mirrored = [s for s in states.values() if s.mirrored]
        m.set("kvstore_tier_segments", len(mirrored), tier="s3")
        m.set("kvstore_tier_bytes", sum(s.size for s in mirrored), tier="s3")
        m.set("kvstore_tier_segments_remote_only", sum(not s.local for s in states.values()))
        m.set("kvstore_tier_segments", self.space.local[0], tier="local")
        m.set("kvstore_tier_bytes", self.space.local[1], tier="local")

    # -- adopting a bucket read-only ------------------------------------------

    async def _follow_bucket(self) -> None:
        while True:
            await asyncio.sleep(self.config.s3_refresh_s)
            try:
                await self.follow_bucket()
            except (TierError, CorruptionError, OSError) as e:
                log.warning("following the bucket failed (will retry): %s", e)

    async def follow_bucket(self) -> int:
        """An adopted node: take the owner's registry changes and index the
        segments it sealed since; forget deleted tenants. Returns how many
        segments were added."""
        assert self.tier is not None
        doc = await fetch_registry(self.tier)
        reg_path = self.config.data_dir / "registry.json"
        if doc is not None and doc != await self._run(reg_path.read_bytes):
            await self._run(atomic_write, reg_path, doc)
            await self._run(self._registry.refresh)
        listing = await list_bucket(self.tier)
        names = set(self._registry.names())
        for gone in await self._run(self._index.tenants) - names:
            await self._run(self._life.tenant_deleted, gone)
            self._cache.forget_tenant(gone)
            await self._run(shutil.rmtree, self.config.data_dir / "segments" / gone, True)
            self._remote_only = {k for k in self._remote_only if k[0] != gone}
        added = 0
        for name in sorted(names):
            inc = self._registry.get(name).created_ns
            objects = listing.get(name, {}).get(inc, {})
            known = await self._run(self._index.segments, name)
            for sid in sorted(set(objects) - set(known)):
                footer = await fetch_footer(self.tier, segment_object(name, inc, sid), objects[sid], name, sid)
                await self._run(index_tier_segment, self._life, name, sid, objects[sid], footer)
                self._remote_only.add((name, sid))
                added += 1
        return added


# -- the bucket at start-up ---------------------------------------------------

Listing = dict[str, dict[int, dict[int, int]]]  # tenant -> incarnation -> segment id -> object size
FOOTER_FETCH_TIMEOUT_S = 120
FOOTER_FETCHES = 32  # footers fetched at once when recovery indexes segments from the object tier


def remote_segments(
    tier: Tier | None, registry: Registry, listing: Listing, loop: asyncio.AbstractEventLoop
) -> dict[str, RemoteSegments] | None:
    """What the object tier holds of each tenant's current incarnation, for
    recovery (which runs on a thread: footers are fetched on ``loop``)."""
    if tier is None:
        return None

    def footers(tenant: str, incarnation: int) -> RemoteSegments:
        ahead: dict[int, concurrent.futures.Future[RemoteFooter]] = {}

        def one(sid: int, size: int) -> Coroutine[Any, Any, RemoteFooter]:
            return fetch_footer(tier, segment_object(tenant, incarnation, sid), size, tenant, sid)

        def fetch(sid: int, size: int) -> RemoteFooter:
            fut = ahead.pop(sid, None)
            if fut is None:
                fut = asyncio.run_coroutine_threadsafe(one(sid, size), loop)
            return fut.result(FOOTER_FETCH_TIMEOUT_S)

        def prefetch(items: list[tuple[int, int]]) -> None:
            gate = asyncio.Semaphore(FOOTER_FETCHES)

            async def gated(sid: int, size: int) -> RemoteFooter:
                async with gate:
                    return await one(sid, size)

            for sid, size in items:  # (the semaphore is made and used on the loop's thread only)
                ahead[sid] = asyncio.run_coroutine_threadsafe(gated(sid, size), loop)

        objects = listing.get(tenant, {}).get(incarnation, {})
        return RemoteSegments(objects, fetch, prefetch)

    return {name: footers(name, registry.get(name).created_ns) for name in registry.names()}


async def list_bucket(tier: Tier) -> Listing:
    """Segment objects by tenant, incarnation and id (-> size)."""
    out: dict[str, dict[int, dict[int, int]]] = {}
    async for info in tier.list("segments/"):
        obj = parse_segment_object(info.name)
        if obj is not None:
            out.setdefault(obj.tenant, {}).setdefault(obj.incarnation, {})[obj.segment_id] = info.size
    return out


async def fetch_registry(tier: Tier) -> bytes | None:
    info = await tier.head(REGISTRY_OBJECT)
    if info is None:
        return None
    return await tier.read_range(REGISTRY_OBJECT, 0, info.size)


__all__ = ["Listing", "Residency", "ResidencyHooks", "fetch_footer", "fetch_registry", "list_bucket", "remote_segments"]
