"""Takeover: the survivors serve a dead node's sealed and mirrored blocks.

When the fleet declares a node dead, every survivor opens that node's part of
the bucket (``PREFIX/nodes/ID``) as a read-only follower store of its own
(``DATA/adopted/ID``): the dead node's mirrored registry copy (the fleet's
tenants, sealed under the fleet's master key) and its segments' footers,
indexed; the blocks are then read with ranged GETs from the bucket. A
request for a block this node does not hold is answered from the adopted
stores (the block routes, lookups, batch gets), and this node publishes
``stored`` residency events (tier ``object``, cause ``takeover``) for the
adopted blocks that rendezvous hashing over the alive nodes places on it.

When the node comes back (alive again, a new incarnation: it joins only once
its store is open, so it serves what it holds from then on), the survivors
go on serving what they took over beside it for ``fleet_handback_s``, so a
client that placed the node's keys on them by the membership it read last
still finds them until it reads the new one; then they let go: ``removed``
events (cause ``handed_back``), the follower store closed and its directory
removed. No block it held is ever nowhere. Blocks the dead node had not
sealed and mirrored are lost with it: a cache loses latency, not correctness.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.engine.api import MasterKey, Store, node_prefix
from kvstore.errors import KVStoreError, TenantNotFound
from kvstore.fleet.view import ALIVE, DEAD, FleetView
from kvstore.tasks import Background

log = logging.getLogger("kvstore.fleet")

ADOPTED = "adopted"
EVENT_BATCH = 1000


def adopted_config(config: StoreConfig, node_id: str, data_dir: Path) -> StoreConfig:
    """A read-only follower of ``node_id``'s part of the fleet's bucket: no
    rehydration (its reads are ranged GETs; this node's disk is its own
    store's), no fleet of its own."""
    root = config.s3_prefix.strip("/")
    return replace(
        config,
        data_dir=data_dir,
        fleet=False,
        node_id="",
        advertise_url="",
        s3_readonly=True,
        s3_prefix="/".join(p for p in (root, node_prefix(node_id)) if p) if config.s3_bucket else config.s3_prefix,
        tier_dir=str(Path(config.tier_dir) / node_prefix(node_id)) if config.tier_dir else "",
        rehydrate_reads=0,
    )


class Takeover:
    """The adopted stores of one node. ``local``: this node's own store
    (its event bus tells the adoption); ``me``: this node's URL, for the
    placement of the adopted blocks."""

    def __init__(self, local: Store, config: StoreConfig, master: MasterKey, me: str) -> None:
        self.local = local
        self.config = config
        self.master = master
        self.me = me
        self.adopted: dict[str, Store] = {}
        self._incarnation: dict[str, int] = {}  # the incarnation each adoption is of
        self._returning: dict[str, asyncio.Task[None]] = {}  # nodes back, handed back after fleet_handback_s
        self._tasks = Background()
        self._lock = asyncio.Lock()
        self.view = FleetView(0, ())
        # Called when the adopted stores change: the writer publishes its state to
        # its readers at once (kvstore/fleet/shared.py), not at the next period.
        self.changed: Callable[[], None] | None = None

    def _dir(self, node_id: str) -> Path:
        return Path(self.config.data_dir) / ADOPTED / node_id

    async def on_view(self, old: FleetView, new: FleetView) -> None:
        """The fleet's membership changed: adopt the newly dead, hand back the
        returned, in the background (opening a dead node's part of the bucket
        reads its segments' footers: the heartbeat loop must not wait for it)."""
        self.view = new
        self._tasks.spawn(self._apply(new, asyncio.get_running_loop().time()), f"takeover-v{new.version}")

    async def _apply(self, new: FleetView, seen: float) -> None:
        """``seen``: when this node learned of ``new`` (the loop's clock),
        from which a takeover's duration counts."""
        async with self._lock:
            if new is not self.view:
                return  # a newer view is on its way

            members = {m.id for m in new.members}
            for gone in [n for n in self.adopted if n not in members]:  # forgotten for good (decommissioned)
                if gone in self._returning:
                    self._returning.pop(gone).cancel()
                await self._hand_back(gone, "decommissioned")
            for m in new.members:
                if m.id == self.config.node_id:
                    continue
                held = m.id in self.adopted
                if m.state == DEAD and not held:
                    await self._adopt(m.id, m.incarnation, seen)
                elif m.state == DEAD and m.id in self._returning:  # gone again before it was handed back
                    self._returning.pop(m.id).cancel()
                    log.warning("node %s is dead again: its blocks stay served here", m.id)
                elif (
                    held
                    and m.id not in self._returning
                    and (m.state == ALIVE or m.incarnation != self._incarnation.get(m.id))
                ):
                    self._returning[m.id] = self._tasks.spawn(self._hand_back_later(m.id), f"hand-back-{m.id}")

    async def start(self, view: FleetView) -> None:
        """At start-up: adopt the nodes already dead, drop adoptions left from before."""
        self.view = view
        base = Path(self.config.data_dir) / ADOPTED
        if base.exists():
            await asyncio.to_thread(shutil.rmtree, base, True)  # the fleet says afresh what to adopt
        await self._apply(view, asyncio.get_running_loop().time())

    async def _adopt(self, node_id: str, incarnation: int, seen: float) -> None:
        """Open ``node_id``'s part of the bucket and serve it. Its duration,
        from ``seen`` (when this node learned the node was dead: a wait for
        an earlier takeover counts) until its blocks are served, goes to
        ``kvstore_fleet_takeover_seconds``; a failed one counts in
        ``kvstore_fleet_takeovers_failed_total`` (and the node stays in
        ``kvstore_fleet_takeover_pending``, kvstore/fleet/metrics.py)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        d = self._dir(node_id)
        try:
            store = await Store.open(adopted_config(self.config, node_id, d), self.master)
        except KVStoreError as e:
            log.warning("cannot take over node %s's blocks: %s", node_id, e)
            self.local.metrics.inc("kvstore_fleet_takeovers_failed_total")
            return
        self.adopted[node_id] = store
        self._incarnation[node_id] = incarnation
        if self.changed is not None:
            self.changed()
        now = loop.time()
        self.local.metrics.observe("kvstore_fleet_takeover_seconds", now - seen)
        log.warning(
            "took over node %s's blocks in the bucket (opened in %.2f s, %.2f s after it was seen dead)",
            node_id,
            now - t0,
            now - seen,
        )
        await self._tell(store, "stored", "takeover")

    async def _hand_back_later(self, node_id: str) -> None:
        """Hand ``node_id``'s blocks back after ``fleet_handback_s`` (module doc)."""
        log.warning(
            "node %s returned: the blocks taken over from it stay served here too for %g s (fleet_handback_s)",
            node_id,
            self.config.fleet_handback_s,
        )
        await asyncio.sleep(self.config.fleet_handback_s)
        async with self._lock:
            self._returning.pop(node_id, None)
            if node_id in self.adopted:
                await self._hand_back(node_id, "handed_back")

    async def _hand_back(self, node_id: str, cause: str) -> None:
        store = self.adopted.pop(node_id)
        self._incarnation.pop(node_id, None)
        if self.changed is not None:
            self.changed()
        await self._tell(store, "removed", cause)
        await store.close()
        await asyncio.to_thread(shutil.rmtree, self._dir(node_id), True)
        if cause == "handed_back":
            log.warning("node %s is back: its blocks are its own again", node_id)
        else:
            log.warning("node %s was forgotten by the fleet: its blocks are no longer served", node_id)

    async def _tell(self, store: Store, kind: str, cause: str) -> None:
        """Residency events for the adopted blocks rendezvous hashing places on this node."""
        bus = self.local.events
        if bus is None:
            return
        for tenant in store.tenant_names():
            after: str | None = None
            while True:
                try:
                    page, after = await store.list_keys(tenant, "", after, EVENT_BATCH)
                except TenantNotFound:
                    break
                mine = [(k, n) for k, n in page if self.view.owner(k) == self.me]
                if mine:
                    bus.publish(
                        tenant,
                        kind,  # type: ignore[arg-type]
                        cause,
                        "object",
                        [k for k, _ in mine],
                        [n for _, n in mine],
                        topic=self.local.events_topic(tenant),
                    )
                if after is None:
                    break

    def store_for(self, tenant: str, key: str) -> Store | None:
        """The adopted store that holds ``key`` of ``tenant`` (None: none does)."""
        for store in self.adopted.values():
            try:
                if store.holds(tenant, key):
                    return store
            except KVStoreError:  # (its registry lacks the tenant: not there)
                continue
        return None

    def present(self, tenant: str, keys: list[str], present: list[bool]) -> list[bool]:
        """``present`` with the keys the adopted stores hold added."""
        if not self.adopted or all(present):
            return present
        return [p or self.store_for(tenant, k) is not None for k, p in zip(keys, present, strict=True)]

    async def close(self) -> None:
        await self._tasks.close()
        for node_id in list(self.adopted):
            store = self.adopted.pop(node_id)
            await store.close()
