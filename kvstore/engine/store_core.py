"""What the store's parts share: its state, the thread pool, the checks.

:class:`kvstore.engine.store.Store` is put together from this core, the read
path (store_read.py), the write path (store_write.py), tenants
(store_tenants.py) and maintenance on demand (store_maintenance.py), one file
per verb; store.py opens and closes it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvstore_client.wire.sealing import aad

from kvstore.config import StoreConfig
from kvstore.engine.access import AccessLog
from kvstore.engine.admission import Admission
from kvstore.engine.appender import Appender, OpenSegment
from kvstore.engine.compactor import Compactor
from kvstore.engine.crypto import MasterKey, open_small, seal_small, small_version
from kvstore.engine.decoded import DecodedCache
from kvstore.engine.index import Index, IndexEntry
from kvstore.engine.lifecycle import Leases, Lifecycle
from kvstore.engine.object_tier import tier_from_config
from kvstore.engine.recovery import RecoveryReport
from kvstore.engine.registry import Registry, Tenant
from kvstore.engine.reserve import SpaceReserve
from kvstore.engine.residency import Residency
from kvstore.engine.retention import Retention
from kvstore.engine.segcache import SegmentCache
from kvstore.errors import (
    KVStoreError,
    ReadOnlyNode,
    ReadOnlyStore,
    StoreClosed,
    TenantNotFound,
    TierError,
)
from kvstore.events.bus import EventBus
from kvstore.events.model import BlockMeta, TierName
from kvstore.metrics import Metrics
from kvstore.names import validate_tenant
from kvstore.qos.policy import Qos
from kvstore.tier.base import Tier

if TYPE_CHECKING:
    from kvstore.engine.store_write_plans import WritePlan

log = logging.getLogger("kvstore.engine.store")
T = TypeVar("T")


class RegistryCoordinator(Protocol):
    """Who else must agree to a registry change (kvstore/fleet/registry.py:
    the fleet's registry in the bucket): ``change`` runs ``apply`` (a change
    of this store's registry) so that it lands there too, redoing it if
    needed; ``sync`` takes in what others changed."""

    async def change(self, apply: Callable[[], Awaitable[T]]) -> T: ...

    async def sync(self) -> bool: ...


class StoreCore:
    """The state every part of the store works on; see :class:`Store`."""

    def __init__(self, config: StoreConfig, master: MasterKey, tier: Tier | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.recovery = RecoveryReport()
        self._master = master
        self._root = Path(config.data_dir)
        self._seg_root = self._root / "segments"
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="kvstore-io")
        self._lock_fd = -1
        self._closed = True
        self._registry: Registry
        self._index: Index
        self._tails: dict[str, OpenSegment] = {}
        self._appenders: dict[str, Appender] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._cache = SegmentCache(self._seg_root, config.max_open_segments)
        self._deleting: set[str] = set()
        self._enforcing: dict[str, asyncio.Task[int]] = {}  # tenant -> its lowered quota's enforcement
        # tenant -> (the QoS fields it set, as the registry holds them; its QoS):
        # asked on every request (store_tenants.qos), made again when they change
        self._qos: dict[str, tuple[dict[str, int], Qos]] = {}
        self._write_plans: dict[str, WritePlan] = {}  # open write plans by id (store_write_plans.py)
        self.readonly = False
        self.adopted = config.s3_readonly  # serves a bucket another node writes
        self._unreachable_at_open: TierError | None = None  # the object tier did not answer at start-up
        self.tier = tier if tier is not None else tier_from_config(config)
        self._own_tier = tier is None and self.tier is not None
        self._residency: Residency
        self._stale: list[str] = []
        self._life: Lifecycle
        self._compactor: Compactor
        self._retention: Retention
        self.reserve: SpaceReserve | None = None  # the writer's (reserve.py)
        self.leases = Leases()
        self.access = AccessLog()
        # Offers of new blocks, for tenants with admit_after > 1: counted by
        # the writer, which every write reaches (admission.py).
        self.admission = Admission(config.admission_keys, self.metrics)
        self.decoded = DecodedCache(config.decoded_cache_bytes, self.metrics)
        self._background = True
        self.events: EventBus | None = None  # set by the daemon where events are on (the writer)
        # A fleet node (kvstore/fleet/, set by the daemon): writes are refused
        # while ``fence`` raises, and registry changes go through the fleet's.
        self.fence: Callable[[], None] | None = None
        self.fleet_registry: RegistryCoordinator | None = None

    # -- helpers --------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def _maintain(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`_run` for a removal or maintenance step: if it finds the
        disk full, the space reserve is released and it runs once more."""
        call = functools.partial(fn, *args)
        reserve = self.reserve
        return await self._run(call if reserve is None else functools.partial(reserve.spending, call))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is not open")

    def _check_writable(self) -> None:
        self._check_open()
        if self.adopted:
            raise ReadOnlyNode("this node serves a bucket read-only (s3_readonly); write to the node that owns it")
        if self.readonly:
            raise ReadOnlyStore("this process serves reads only; writes go to the writer process")
        if self.fence is not None:
            self.fence()

    def _tenant(self, name: str) -> Tenant:
        self._check_open()
        validate_tenant(name)
        if name in self._deleting:
            raise TenantNotFound(f"tenant {name!r} does not exist")
        return self._registry.get(name)

    def _appender(self, t: Tenant) -> Appender:
        """The appender of tenant ``t``, as it is now: a write that began
        before its tenant was deleted (and maybe created again) must never
        land in what comes after."""
        self._check_writable()
        if (
            t.name in self._deleting
            or t.name not in self._registry
            or self._registry.get(t.name).created_ns != t.created_ns
        ):
            raise TenantNotFound(f"tenant {t.name!r} was deleted while the request was in progress")
        return self._appender_of(t)

    def _appender_of(self, t: Tenant) -> Appender:
        """Tenant ``t``'s appender, made on first use, without the checks of
        :meth:`_appender` (the store's own close seals through it)."""
        app = self._appenders.get(t.name)
        if app is None:
            tail = self._tails.setdefault(t.name, OpenSegment(None))
            app = Appender(
                t.name,
                self._seg_root / t.name,
                t.policy == "direct",
                tail,
                self._index,
                self._life,
                self.config,
                self._pool,
                self.metrics,
                self._cache.register,
                functools.partial(self._sealed_elsewhere, asyncio.get_running_loop(), t.name),
                self.reserve,
            )
            self._appenders[t.name] = app
        return app

    # -- what residency asks (residency.ResidencyHooks) ----------------------

    async def drop_segment_entries(self, tenant: str, sid: int) -> int:
        """Remove every entry pointing into segment ``sid`` (it is being
        dropped), through the tenant's appender; returns how many."""
        victims = await self._run(self._index.entries_in, tenant, sid)
        if not victims:
            return 0
        metas = self._identities(tenant, [k for k, _ in victims])
        gone = set(await self._appender(self._registry.get(tenant)).drop(victims))
        self._removed(tenant, "evicted", [(k, e) for k, e in victims if k in gone], metas, "local")
        return len(gone)

    # -- residency events -------------------------------------------------------

    def _ident_blob(self, t: Tenant, key: str, meta: BlockMeta) -> bytes:
        """A block's engine identity as indexed: sealed under the tenant's
        data key for a sealed tenant (token ids are the prompt's plaintext)."""
        raw = meta.pack()
        if not t.sealed:
            return raw
        return seal_small(self._registry.data_key(t.name, t.key_version), t.key_version, raw, _ident_aad(t.name, key))

    def seal_for(self, tenant: str, data: bytes, aad: bytes) -> bytes:
        """Small metadata of ``tenant`` as it may be stored: sealed under the
        tenant's data key (AES-GCM, ``aad`` bound) for a sealed tenant, as
        is for a direct one. :meth:`open_for` reverses it."""
        t = self._tenant(tenant)
        if not t.sealed:
            return data
        return seal_small(self._registry.data_key(t.name, t.key_version), t.key_version, data, aad)

    def open_for(self, tenant: str, blob: bytes, aad: bytes) -> bytes:
        t = self._tenant(tenant)
        if not t.sealed:
            return blob
        return open_small(self._registry.data_key(tenant, small_version(blob)), blob, aad)

    def _identities(self, tenant: str, keys: Sequence[str]) -> dict[str, BlockMeta]:
        """The engine identities of ``keys`` as stored (the key's hash for a
        block stored without one); nothing when no one listens."""
        if self.events is None or not keys:
            return {}
        t = self._registry.get(tenant) if tenant in self._registry else None
        out: dict[str, BlockMeta] = {}
        for key, blob in zip(keys, self._index.idents(tenant, keys), strict=True):
            meta = None
            if blob is not None and t is not None:
                try:
                    raw = (
                        open_small(self._registry.data_key(tenant, small_version(blob)), blob, _ident_aad(tenant, key))
                        if t.sealed
                        else blob
                    )
                    meta = BlockMeta.unpack(raw)
                except (KVStoreError, ValueError) as e:
                    log.warning(
                        "the engine identity of %s/%s is unreadable (%s): its key's hash is used", tenant, key, e
                    )
            out[key] = meta or BlockMeta.of_key(key)
        return out

    def _stored(
        self,
        tenant: str,
        cause: str,
        tier: TierName,
        keys: Sequence[str],
        sizes: Sequence[int],
        metas: Sequence[BlockMeta] | None = None,
    ) -> None:
        if self.events is not None and keys:
            self.events.publish(tenant, "stored", cause, tier, keys, sizes, metas, self._topic(tenant))

    def _removed(
        self,
        tenant: str,
        cause: str,
        entries: Sequence[tuple[str, IndexEntry]],
        metas: Mapping[str, BlockMeta],
        tier: TierName | None = None,
    ) -> None:
        """Blocks gone: each from the tier it was read from (its segment's
        local copy, else the object tier), unless ``tier`` says. ``metas``:
        their identities, read before they went."""
        if self.events is None or not entries:
            return
        by_tier: dict[TierName, list[str]] = {}
        for key, entry in entries:
            where = tier or self._tier_of(tenant, entry.segment_id)
            by_tier.setdefault(where, []).append(key)
        for where, keys in by_tier.items():
            ids = [metas.get(k) or BlockMeta.of_key(k) for k in keys]
            self.events.publish(tenant, "removed", cause, where, keys, (), ids, self._topic(tenant))

    def _topic(self, tenant: str) -> str:
        """The tenant's events topic ("" for its name)."""
        return self._registry.get(tenant).events_topic if tenant in self._registry else ""

    def _tier_of(self, tenant: str, segment_id: int) -> TierName:
        ts = self._index.tier_state(tenant, segment_id)
        return "local" if ts is None or ts.local else "object"

    async def carry_tombstones(self, tenant: str, sid: int) -> int:
        """Copy forward the tombstones of ``sid`` an older segment still needs
        (it is dropped without being compacted)."""
        return await self._compactor.carry_tombstones(tenant, sid)

    def disk_full(self) -> None:
        """On the loop: the disk filled (the reserve was released, or a put
        refused for space): compaction runs now, the evictor too."""
        self._compactor.kick()
        self._residency.kick()

    async def segment_moved(self, tenant: str, segment_id: int, to: TierName) -> None:
        """A segment's blocks are now read from ``to`` (its local copy was
        dropped: ``object``; it was rehydrated: ``local``)."""
        if self.events is None:
            return
        entries = await self._run(self._index.entries_in, tenant, segment_id)
        if self.events is None or not entries:
            return
        keys = [k for k, _ in entries]
        ids = self._identities(tenant, keys)
        metas = [ids[k] for k in keys]
        cause = "moved" if to == "object" else "rehydrated"
        topic = self._topic(tenant)
        self.events.publish(tenant, "stored", cause, to, keys, [e.logical_size for _, e in entries], metas, topic)
        self.events.publish(tenant, "removed", cause, "object" if to == "local" else "local", keys, (), metas, topic)

    def _sealed_elsewhere(self, loop: asyncio.AbstractEventLoop, tenant: str, segment_id: int) -> None:
        """An appender thread sealed a segment: the segment cache may close it
        from now on; tell the tiering, on the loop."""
        self._cache.sealed((tenant, segment_id))
        loop.call_soon_threadsafe(self._residency.sealed, tenant, segment_id)

    async def _serialize(self, tenant: str, key: str) -> asyncio.Future[None]:
        """Wait for any write in flight on (tenant, key), then claim it."""
        k = (tenant, key)
        while (other := self._inflight.get(k)) is not None:
            await asyncio.wait({other})
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inflight[k] = fut
        return fut

    def _release(self, tenant: str, key: str, fut: asyncio.Future[None]) -> None:
        del self._inflight[(tenant, key)]
        fut.set_result(None)


def _ident_aad(tenant: str, key: str) -> bytes:
    return aad(b"kvstore/v1 ident", tenant, key)
