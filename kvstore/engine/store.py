"""The storage engine's async API: tenants, and blocks under (tenant, key).

Data directory layout::

    DATA/LOCK               flock: one process opens a store at a time
    DATA/registry.json      tenants, policies, wrapped data keys (registry.py)
    DATA/index/             LMDB index, rebuildable from segments (index.py)
    DATA/segments/TENANT/   that tenant's segment files (segment.py)
    DATA/reserve            space only removals and maintenance may use (reserve.py)

With an object tier (G4: S3 or a shared directory), sealed segments of
persistent tenants are mirrored there, local copies may be dropped under disk
pressure and read back by ranged GETs, and a node on an empty disk rebuilds
from the bucket (residency.py, mirror.py, space.py).

CPU and disk work runs on a bounded thread pool; the event loop only routes
and does index lookups (LMDB reads of a memory map, microseconds each).
Writes of one key are serialized (first write wins: a second put of a key is
a no-op; a delete waits for a put in flight on the same key).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import time
from dataclasses import replace
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.engine import directio, tails
from kvstore.engine.appender import OpenSegment
from kvstore.engine.compactor import Compactor
from kvstore.engine.crypto import MasterKey
from kvstore.engine.format import ALIGN
from kvstore.engine.index import Index
from kvstore.engine.layout import tenant_prefix
from kvstore.engine.lifecycle import Lifecycle
from kvstore.engine.mirror import Mirror
from kvstore.engine.object_tier import refusal
from kvstore.engine.recovery import RecoveryReport, UnknownTenants, recover, tenant_dirs
from kvstore.engine.registry import Registry, RegistryUnreadable, UnknownTenantSetting
from kvstore.engine.reserve import RESERVE_FILE, SpaceReserve, auto_reserve, segment_cap
from kvstore.engine.residency import Listing, Residency, fetch_registry, list_bucket, remote_segments
from kvstore.engine.retention import Retention
from kvstore.engine.store_maintenance import StoreMaintenance
from kvstore.engine.store_read import StoreReads
from kvstore.engine.store_sealing import StoreSealing
from kvstore.engine.store_tenants import StoreTenants
from kvstore.engine.store_write import StoreWrites
from kvstore.engine.store_write_plans import StoreWritePlans
from kvstore.engine.unsynced import index_torn_by_reboot, mark_index_synced, mark_index_unsynced
from kvstore.errors import (
    ConfigError,
    IndexUnusable,
    KVStoreError,
    StoreLocked,
    TierError,
    TierMisconfigured,
)
from kvstore.fsutil import atomic_write
from kvstore.tier.base import Tier

log = logging.getLogger("kvstore.engine.store")


class Store(StoreTenants, StoreMaintenance, StoreSealing, StoreReads, StoreWrites, StoreWritePlans):
    """Open with :meth:`open`; close with :meth:`close` (drains queued writes;
    with an object tier, seals and uploads the open segments first).
    Reads are in store_read.py, writes in store_write.py, tenants and their
    credentials in store_tenants.py, maintenance on demand in
    store_maintenance.py, sealing by age and at a stop in store_sealing.py;
    this file opens and closes the store."""

    # -- life cycle -----------------------------------------------------------

    @classmethod
    async def open(
        cls, config: StoreConfig, master: MasterKey, tier: Tier | None = None, background: bool = True
    ) -> Store:
        """Open the store for reads and writes: take its lock, run recovery.
        ``tier``: the object tier (default: the one the config names, if any).
        ``background``: run uploads, eviction, compaction and TTL sweeps (an
        offline repair tool turns them off)."""
        store = cls(config, master, tier)
        store._background = background
        return await cls._opened(store, readonly=False)

    @classmethod
    async def open_reader(cls, config: StoreConfig, master: MasterKey, tier: Tier | None = None) -> Store:
        """Open a store that another process (the writer) has open, for reads
        only: no lock, no recovery; registry changes are picked up as the
        writer makes them. Writes raise :class:`ReadOnlyStore`."""
        return await cls._opened(cls(config, master, tier), readonly=True)

    @staticmethod
    async def _opened(store: Store, readonly: bool) -> Store:
        store.readonly = readonly
        try:
            if readonly:
                await store._run(store._open_reader_sync)
            else:
                listing, id_floor = await store._survey_bucket()
                await store._run(store._open_sync, listing, id_floor, asyncio.get_running_loop())
            await store._start_residency(readonly)
        except BaseException:
            await store._run(store._release_after_failed_open)
            store._pool.shutdown(wait=False)
            if store._own_tier and store.tier is not None:
                await store.tier.close()
            raise
        store._closed = False
        return store

    async def _survey_bucket(self) -> tuple[Listing | None, int]:
        """What the object tier holds, before recovery; restores (or, adopting,
        takes) the tenant registry from it. (None, id floor) when it cannot be
        listed: new segment ids then start past the current time in
        microseconds, past any id an earlier run of this node can have used."""
        if self.tier is None:
            return None, 0
        reg_path = self._root / "registry.json"
        try:
            listing = await list_bucket(self.tier)
            doc = await fetch_registry(self.tier) if self.adopted or not reg_path.exists() else None
        except TierMisconfigured as e:  # a setting to fix: no bucket, no access, no credentials
            raise refusal(self.config, self.tier, e) from None
        except TierError as e:
            if self.adopted:
                raise ConfigError(f"s3_readonly: the bucket cannot be read, so there is nothing to serve: {e}") from e
            log.error("object tier unreachable at start-up (%s); serving local data until it answers", e)
            self._unreachable_at_open = e
            return None, time.time_ns() // 1000
        if doc is None and self.adopted:
            raise ConfigError("s3_readonly: the bucket holds no registry.json: no node has written to it")
        if doc is not None:
            await self._run(self._root.mkdir, 0o700, True, True)
            await self._run(atomic_write, reg_path, doc)
            if not self.adopted:
                log.warning("restored the tenant registry from the object tier")
        return listing, 0

    async def _start_residency(self, readonly: bool) -> None:
        """Build the residency, then what its hooks call (the compactor and
        retention), then start them: nothing runs before what it calls exists."""
        writer = not readonly
        self._residency = Residency(
            self.config,
            self._index,
            self._registry,
            self._cache,
            self._life,
            self.leases,
            self.metrics,
            self._run,
            self.tier,
            hooks=self if writer else None,
            reserve=self.reserve,
            writer=writer,
            adopted=self.adopted,
        )
        self._compactor = Compactor(
            self.config,
            self._index,
            self._life,
            self.leases,
            self._registry,
            self._cache,
            self._residency,
            lambda name: self._appender(self._registry.get(name)),
            self._maintain,
            self.metrics,
            available=self._room_for_maintenance,
        )
        self._retention = Retention(
            self._index,
            self._registry,
            self.access,
            lambda name: self._appender(self._registry.get(name)),
            self._run,
            self.metrics,
            removed=self._removed,
            identities=self._identities,
            leases=self.leases,
            eviction=self.config.quota_eviction,
        )
        if self.reserve is not None:
            loop = asyncio.get_running_loop()

            def released(_freed: int) -> None:
                loop.call_soon_threadsafe(self.disk_full)

            self.reserve.on_release = released
        mirror = None
        if self.tier is not None and writer and not self.adopted and self._background:
            mirror = Mirror(
                self.tier,
                self._life,
                self.metrics,
                self._maintain,
                self._registry.document,
                self.config.s3_upload_concurrency,
                self._residency.mirrored,
            )
            self._registry.on_change = mirror.registry_changed
            mirror.registry_changed()  # the bucket gets this node's registry now
            if self._unreachable_at_open is not None:  # until a call goes through
                mirror.mark_unreachable(self._unreachable_at_open)
        await self._residency.start(mirror, self._background)
        if writer and not self.adopted and self._background:
            self._residency.spawn(self._compactor.loop(), "compactor")
            self._residency.spawn(self._retention.checkpointer(), "access-checkpoints")
            self._residency.spawn(self._retention.sweeper(self.config.ttl_sweep_s), "ttl-sweeper")
        if mirror is not None and self.config.seal_after > 0:
            self._residency.spawn(self.sealer(self.config.seal_after), "sealer")
        if writer and not self.adopted:
            self._residency.spawn(self.write_plan_sweeper(), "write-plan-sweeper")
        if mirror is not None:
            for prefix in self._stale:
                log.warning("deleting objects of a deleted tenant under %s", prefix)
                mirror.delete_prefix(prefix)

    def _open_reader_sync(self) -> None:
        self._registry = Registry(self._root / "registry.json", self._master, readonly=True)
        self._index = Index(self._root / "index", readonly=True)
        self._life = Lifecycle(self._index)

    def _stale_prefixes(self, listing: Listing) -> list[str]:
        """Bucket prefixes of deleted tenants (or deleted incarnations)."""
        out = []
        for name, incarnations in listing.items():
            current = self._registry.get(name).created_ns if name in self._registry else None
            out += [tenant_prefix(name, inc) for inc in incarnations if inc != current]
        return out

    def _open_sync(self, listing: Listing | None, id_floor: int, loop: asyncio.AbstractEventLoop) -> None:
        self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self._root / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise StoreLocked(f"data directory {str(self._root)!r} is in use by another process") from None
        _raise_nofile_limit()
        _remove_leftovers(self._root)
        if self.config.direct_io == "on" and not directio.supported(self._root):
            raise ConfigError(f"direct_io = on: the filesystem of {str(self._root)!r} does not take O_DIRECT")
        self._set_aside_space()
        self._registry = self._load_registry()
        index_dir = self._root / "index"
        has_segments = bool(tenant_dirs(self._seg_root))
        rebuilt = has_segments and not (index_dir / "data.mdb").exists()
        if index_torn_by_reboot(self._root):
            log.error("the machine restarted while the index was not synced (durability = interval): rebuilding it")
            Index.destroy(index_dir)
            rebuilt = has_segments
        sync = self.config.durability == "fsync"
        reserve = self.reserve
        assert reserve is not None
        try:
            self._index = reserve.spending(lambda: Index(index_dir, sync=sync))
        except IndexUnusable as e:
            log.error("%s; rebuilding the index from the segments", e)
            Index.destroy(index_dir)
            self._index = reserve.spending(lambda: Index(index_dir, sync=sync))
            rebuilt = has_segments
        self._life = Lifecycle(self._index)
        remote = remote_segments(self.tier, self._registry, listing, loop) if listing is not None else None
        stopped = tails.read(self._root)  # what the last clean stop left (used once)

        def recovered() -> dict[str, OpenSegment]:
            # Recovery converges from any point it stopped at, so on a full
            # disk it runs again with part of the space reserve released.
            self.recovery = RecoveryReport(index_rebuilt=rebuilt)
            tails = recover(
                self._seg_root,
                self._index,
                self._life,
                self._registry,
                self.recovery,
                remote,
                id_floor,
                self.config.discard_unknown_tenants,
                stopped,
            )
            if not sync:
                mark_index_unsynced(self._root)
            return tails

        self._tails = reserve.spending(recovered)
        tails.discard(self._root)
        if not reserve.fill():
            log.warning(
                "the disk is full at start-up: the space reserve (%d bytes) cannot be allocated; puts are "
                "refused (507) until removals and compaction free space",
                reserve.size,
            )
        opened = time.monotonic()
        for tail in self._tails.values():
            if tail.segment is not None:
                self._cache.register(tail.segment)
                if tail.segment.size > ALIGN:  # records left unsealed by the last run: aged from now
                    tail.unsealed_since = opened
        self._stale = self._stale_prefixes(listing) if listing is not None and not self.adopted else []
        r = self.recovery
        self.metrics.set("kvstore_recovery_records_replayed", r.records_replayed)
        self.metrics.set("kvstore_recovery_entries_dropped", r.entries_dropped)
        self.metrics.set("kvstore_recovery_truncated_segments", len(r.truncated))
        self.metrics.set("kvstore_recovery_corrupt_records", len(r.corrupt))
        if r.repaired or r.corrupt:
            log.warning("recovery of %s: repairs made or damage found", self._root, extra=r.as_dict())

    def _set_aside_space(self) -> None:
        """Size segments and the space reserve (reserve.py) for the data
        directory's filesystem."""
        st = os.statvfs(self._root)
        room = st.f_blocks * st.f_frsize
        if self.config.capacity:
            room = min(room, self.config.capacity)
        cap = segment_cap(self.config.segment_size, room)
        if cap < self.config.segment_size:
            log.warning(
                "segment_size %d is over a sixteenth of the space the data directory may use (%d bytes): "
                "segments are sealed at %d bytes, so compaction can always rewrite one within the reserve",
                self.config.segment_size,
                room,
                cap,
            )
            self.config = replace(self.config, segment_size=cap)
        size = self.config.space_reserve or auto_reserve(self.config.segment_size, room)
        self.reserve = SpaceReserve(self._root / RESERVE_FILE, size, self._fs_available)

    def _fs_available(self) -> int:
        """Bytes free for this user on the data directory's filesystem."""
        st = os.statvfs(self._root)
        return st.f_bavail * st.f_frsize

    def _room_for_maintenance(self) -> int:
        """Bytes maintenance may still write: free space and what is left of the reserve."""
        return self._fs_available() + (self.reserve.held if self.reserve is not None else 0)

    def _load_registry(self) -> Registry:
        """The tenant registry. A missing or unreadable registry next to tenant
        data stops start-up (naming the tenants) instead of dropping the data."""
        path = self._root / "registry.json"
        present = tenant_dirs(self._seg_root)
        if not path.exists() and present and not self.config.discard_unknown_tenants:
            raise UnknownTenants(sorted(present), "is missing")
        try:
            return Registry(path, self._master, readonly=self.adopted)
        except RegistryUnreadable as e:
            if present and not isinstance(e, UnknownTenantSetting):
                raise UnknownTenants(sorted(present), f"cannot be read ({e})") from None
            raise

    def _release_after_failed_open(self) -> None:
        for tail in self._tails.values():
            if tail.segment is not None:
                tail.segment.close()
        self._cache.close()
        if hasattr(self, "_index"):
            self._index.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.readonly and not self.adopted and hasattr(self, "_retention"):
            try:
                await self._retention.checkpoint()
                await self._retention.save_states()
            except (KVStoreError, OSError) as e:
                log.error("last checkpoint of access times and eviction states failed: %s", e)
        await self.abandon_all_write_plans()
        mirror = self._residency.mirror if hasattr(self, "_residency") else None
        if mirror is not None:
            await self.seal_for_stop(mirror)
        for app in list(self._appenders.values()):
            await app.close()
        self._appenders.clear()
        await self._residency.close()
        await self._run(self._close_sync)
        if not self.readonly and not self.adopted:  # a clean stop: the next start reads no record header (tails.py)
            left = [
                tails.Tail(name, t.segment.segment_id, t.segment.size, *t.encoded_footer())
                for name, t in self._tails.items()
                if t.segment is not None and not t.segment.sealed
            ]
            try:
                await self._run(tails.write, self._root, left)
            except OSError as e:  # a full disk, say: the next start scans the open segments instead
                log.warning("the open segments' footers could not be kept for the next start: %s", e)
        self._pool.shutdown(wait=True)
        if self._own_tier and self.tier is not None:
            await self.tier.close()

    def _close_sync(self) -> None:
        self._cache.close()
        if not self.readonly:
            self._index.sync()
            mark_index_synced(self._root)
        self._index.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# Files older releases kept in the data directory and this one does not use.
LEFTOVERS = {
    # The QoS token buckets, a file every worker mapped until they moved to shared memory
    # (a first write to a page of it on a full disk killed the worker with SIGBUS).
    "qos-rates": "the QoS buckets live in shared memory now",
}


def _remove_leftovers(root: Path) -> None:
    """Remove what older releases left in the data directory (:data:`LEFTOVERS`), saying so."""
    for name, why in LEFTOVERS.items():
        with contextlib.suppress(FileNotFoundError):
            (root / name).unlink()
            log.info("removed %s, left by an older release: %s", root / name, why)


def _raise_nofile_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
