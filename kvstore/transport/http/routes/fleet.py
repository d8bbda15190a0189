"""The fleet on the HTTP side: joining at start-up, ``GET /v1/fleet``, and
what ``/readyz`` says of a fenced node (kvstore/fleet/)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from kvstore_client.sharding import normalize

from kvstore.config import StoreConfig
from kvstore.engine.api import MasterKey, Store, node_prefix, tier_from_config
from kvstore.errors import FleetOff, NodeAlive, NotFound
from kvstore.fleet.bucket import BucketMembership
from kvstore.fleet.etcd import Etcd, EtcdMembership
from kvstore.fleet.membership import Membership
from kvstore.fleet.node import FleetNode
from kvstore.fleet.registry import FleetRegistry, adopt_at_start
from kvstore.fleet.takeover import Takeover
from kvstore.names import validate_node_id
from kvstore.tasks import Background
from kvstore.tier.base import Tier
from kvstore.transport.http.appkeys import CONFIG, STORE
from kvstore.transport.http.auth import is_admin, require_admin, tenant_of
from kvstore.transport.http.query import query_bool
from kvstore.transport.http.routes.xfer import XFER

log = logging.getLogger("kvstore.fleet")

FLEET = web.AppKey("fleet", FleetNode)
FLEET_TIER = web.AppKey("fleet_tier", Tier)
TAKEOVER = web.AppKey("takeover", Takeover)
routes = web.RouteTableDef()


def fleet_open_ctx(master: MasterKey) -> Callable[[web.Application], AsyncIterator[None]]:
    """Before the store opens: the fleet's prefix of the bucket, and the
    fleet's registry as this node's (so the store opens with the fleet's tenants)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        cfg = app[CONFIG].store
        if not cfg.fleet:
            yield
            return
        tier = tier_from_config(cfg, fleet=True)
        assert tier is not None  # (the settings' check: fleet needs a tier)
        app[FLEET_TIER] = tier
        try:
            if await adopt_at_start(tier, cfg.data_dir / "registry.json", master):
                log.info("took the fleet's tenant registry from the bucket")
            yield
        finally:
            await tier.close()

    return ctx


def fleet_join_ctx(master: MasterKey) -> Callable[[web.Application], AsyncIterator[None]]:
    """Once the store is open: the registry kept in step with the fleet's,
    then join (heartbeats, membership), writes fenced by it, and dead nodes'
    blocks taken over."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        cfg = app[CONFIG].store
        if not cfg.fleet:
            yield
            return
        store, tier = app[STORE], app[FLEET_TIER]
        registry = FleetRegistry(tier, store.registry_document, store.adopt_registry)
        await registry.pull()  # (this node's registry becomes the fleet's where the bucket has none)
        store.fleet_registry = registry
        node = FleetNode(membership_for(cfg, tier), cfg.fleet_heartbeat_s, cfg.fleet_dead_after_s)
        try:
            await node.start()
        except BaseException:
            await node.close()
            raise
        store.fence = node.check_writable
        app[FLEET] = node
        takeover = Takeover(store, cfg, master, normalize(cfg.advertise_url))
        await takeover.start(node.view)
        node.listeners.append(takeover.on_view)
        app[TAKEOVER] = takeover
        xfer = app.get(XFER)
        if xfer is not None:  # NIXL reads of a dead node's blocks: staged from the bucket
            xfer.adopted = takeover.store_for
        tasks = Background()
        tasks.spawn(registry.run(cfg.s3_refresh_s), "fleet-registry")
        try:
            yield
        finally:
            await tasks.close()
            await node.close()
            await takeover.close()

    return ctx


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


def adopted_store(app: web.Application, tenant: str, key: str) -> Store | None:
    """A dead node's store that holds ``key`` (takeover.py); None: none does, or not in a fleet."""
    takeover = app.get(TAKEOVER)
    return takeover.store_for(tenant, key) if takeover is not None else None


def with_adopted(app: web.Application, tenant: str, keys: list[str], present: list[bool]) -> list[bool]:
    """A lookup's ``present`` with the keys taken over from dead nodes."""
    takeover = app.get(TAKEOVER)
    return takeover.present(tenant, keys, present) if takeover is not None else present


def fenced(app: web.Application) -> str:
    """Why this fleet node refuses writes ("" if it does not, or is not in a fleet)."""
    node = app.get(FLEET)
    return node.fenced() if node is not None else ""


@routes.get("/v1/fleet")
async def fleet(request: web.Request) -> web.Response:
    """The fleet's members as this node sees them: the admin token or any tenant's."""
    if not is_admin(request):
        tenant_of(request)
    node = request.app.get(FLEET)
    if node is None:
        raise FleetOff("this node is not in a fleet (the fleet setting is off)")
    return web.json_response(node.view.as_dict())


@routes.delete("/v1/admin/fleet/nodes/{node_id}")
async def forget_node(request: web.Request) -> web.Response:
    """Decommission a dead node: out of the fleet's membership for good (no
    survivor serves its blocks any more); ``?purge=true`` also deletes its
    part of the bucket (its segments, registry copy and heartbeat)."""
    require_admin(request)
    node = request.app.get(FLEET)
    if node is None:
        raise FleetOff("this node is not in a fleet (the fleet setting is off)")
    node_id = validate_node_id(request.match_info["node_id"])
    purge = query_bool(request, "purge", False)
    if node_id == node.node_id:
        raise NodeAlive(f"node {node_id!r} is this node")
    if not await node.remove(node_id):
        raise NotFound(f"no node {node_id!r} in the fleet")
    removed = 0
    if purge:
        tier = request.app[FLEET_TIER]
        names = [info.name async for info in tier.list(node_prefix(node_id) + "/")]
        for name in names:
            await tier.delete(name)
        removed = len(names)
    log.warning("node %s forgotten by the fleet (%d objects of it deleted from the bucket)", node_id, removed)
    return web.json_response({"node": node_id, "objects_deleted": removed})
