"""A fleet node's wiring (``fleet = true``; kvstore/fleet/ holds the parts):
the fleet's bucket and registry before the store opens, then, once it is
open, membership, fencing and takeover. The writer's (or a single
process's): a reader worker follows the writer's store."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvstore_client.sharding import normalize

from kvstore.config import StoreConfig
from kvstore.engine.api import MasterKey, refusal, tier_from_config
from kvstore.errors import TierMisconfigured
from kvstore.fleet import shared
from kvstore.fleet.bucket import BucketMembership
from kvstore.fleet.etcd import Etcd, EtcdMembership
from kvstore.fleet.membership import Membership
from kvstore.fleet.metrics import FleetGauges
from kvstore.fleet.node import FleetNode
from kvstore.fleet.registry import FleetRegistry, adopt_at_start
from kvstore.fleet.shared import FleetFollower, FleetState
from kvstore.fleet.takeover import Takeover
from kvstore.tasks import Background
from kvstore.tier.base import Tier

if TYPE_CHECKING:
    from kvstore.daemon.node import Node

log = logging.getLogger("kvstore.fleet")
PUBLISH_S = 0.5  # how often the writer publishes its fleet state to the readers
STALE_HEARTBEATS = 3  # a state older than this many heartbeats reads as fenced on the readers


@contextlib.asynccontextmanager
async def fleet_bucket(cfg: StoreConfig, master: MasterKey) -> AsyncIterator[Tier | None]:
    """Before the store opens: the fleet's prefix of the bucket, and the
    fleet's registry as this node's (so the store opens with the fleet's
    tenants). None: not a fleet node."""
    if not cfg.fleet:
        yield None
        return
    tier = tier_from_config(cfg, fleet=True)
    assert tier is not None  # (the settings' check: fleet needs a tier)
    try:
        try:
            adopted = await adopt_at_start(tier, cfg.data_dir / "registry.json", master)
        except TierMisconfigured as e:  # one line at start-up (kvstore serve exits 2), not a traceback
            raise refusal(cfg, tier, e) from None
        if adopted:
            log.info("took the fleet's tenant registry from the bucket")
        yield tier
    finally:
        await tier.close()


@contextlib.asynccontextmanager
async def fleet_membership(node: Node, master: MasterKey) -> AsyncIterator[None]:
    """Once the store is open: the registry kept in step with the fleet's,
    then join (heartbeats, membership, the registry checked each heartbeat),
    writes and tenant operations fenced by it, and dead nodes' blocks taken
    over."""
    cfg, tier = node.config.store, node.fleet_tier
    if not cfg.fleet or tier is None:
        yield
        return
    store = node.store
    registry = FleetRegistry(tier, store.registry_document, store.adopt_registry, store.metrics)
    await registry.pull()  # (this node's registry becomes the fleet's where the bucket has none)
    store.fleet_registry = registry
    member = FleetNode(membership_for(cfg, tier), cfg.fleet_heartbeat_s, cfg.fleet_dead_after_s, registry)
    try:
        await member.start()
    except BaseException:
        await member.close()
        raise
    store.fence = member.check_writable
    store.tenant_fence = member.check_tenants
    node.fleet = member
    takeover = Takeover(store, cfg, master, normalize(cfg.advertise_url))
    await takeover.start(member.view)
    member.listeners.append(takeover.on_view)
    node.takeover = takeover
    if node.xfer is not None:  # NIXL reads of a dead node's blocks: staged from the bucket
        node.xfer.adopted = takeover.store_for
    gauges = FleetGauges(member, takeover, store.metrics)  # /metrics: members, fenced, adopted blocks
    await gauges.record()
    member.listeners.append(gauges.on_view)
    tasks = Background()
    tasks.spawn(registry.run(cfg.s3_refresh_s), "fleet-registry")  # a backstop: step() checks every heartbeat
    tasks.spawn(gauges.run(cfg.fleet_heartbeat_s), "fleet-metrics")
    try:
        yield
    finally:
        await tasks.close()
        await member.close()
        await takeover.close()


def membership_for(cfg: StoreConfig, tier: Tier) -> Membership:
    """On etcd where ``fleet_etcd_url`` names one, else in the bucket."""
    if cfg.fleet_etcd_url:
        etcd = Etcd(cfg.fleet_etcd_url, etcd_prefix(cfg), timeout_s=max(1.0, 2 * cfg.fleet_heartbeat_s))
        return EtcdMembership(etcd, cfg.node_id, cfg.advertise_url, cfg.fleet_dead_after_s)
    return BucketMembership(tier, cfg.node_id, cfg.advertise_url, cfg.fleet_dead_after_s)


def etcd_prefix(cfg: StoreConfig) -> str:
    """The fleet's keys in etcd: one prefix per bucket (or shared
    directory) and S3 prefix, so fleets that share an etcd stay apart."""
    where = f"s3/{cfg.s3_bucket}" if cfg.s3_bucket else f"dir/{cfg.tier_dir.strip('/')}"
    prefix = cfg.s3_prefix.strip("/")
    return f"/kvstore/{where}/{prefix}/" if prefix else f"/kvstore/{where}/"


@contextlib.asynccontextmanager
async def publish_state(node: Node, fd: int | None) -> AsyncIterator[None]:
    """A fleet node's writer with reader workers (``fd``: the shared page,
    kvstore/fleet/shared.py): its fleet state published every half
    heartbeat, so the readers answer ``/readyz``, tenant operations and
    reads of taken-over blocks as it would."""
    member = node.fleet
    if fd is None or member is None:
        yield
        return

    def state() -> FleetState:
        takeover = node.takeover
        return FleetState(
            fenced=member.fenced(),
            tenants_fenced=member.tenants_fenced(),
            takeovers=len(takeover.adopted) if takeover is not None else 0,
            registry_version=member.registry_version,
            stamp=time.monotonic(),
            fence_at=member.fence_at(),
            tenants_fence_at=member.tenants_fence_at(),
        )

    shared.publish(fd, state())
    tasks = Background()
    tasks.every(PUBLISH_S, lambda: shared.publish(fd, state()), "fleet-state")
    if node.takeover is not None:  # an adoption or a hand-back reaches the readers at once
        node.takeover.changed = lambda: shared.publish(fd, state())
    try:
        yield
    finally:
        if node.takeover is not None:
            node.takeover.changed = None
        await tasks.close()


@contextlib.asynccontextmanager
async def follow_state(node: Node, fd: int) -> AsyncIterator[None]:
    """A fleet node's reader worker: the writer's fleet state, read from the
    shared page; its tenant operations refused while the writer's are."""
    cfg = node.config.store
    follower = node.follower = FleetFollower(fd, stale_after_s=STALE_HEARTBEATS * cfg.fleet_heartbeat_s + PUBLISH_S)
    node.store.tenant_fence = follower.check_tenants
    try:
        yield
    finally:
        node.store.tenant_fence = None
        follower.close()
