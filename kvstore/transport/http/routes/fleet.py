"""The fleet on the HTTP side: joining at start-up, ``GET /v1/fleet``, and
what ``/readyz`` says of a fenced node (kvstore/fleet/)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiohttp import web
from kvstore_client.wire.headers import FLEET_VERSION

from kvstore.engine.api import Store, node_prefix
from kvstore.errors import FleetOff, Misdirected, NodeAlive, NotFound, Unauthorized
from kvstore.fleet.node import FleetNode
from kvstore.fleet.takeover import Takeover
from kvstore.names import validate_node_id
from kvstore.tier.base import Tier
from kvstore.transport.http.appkeys import FOLLOWER, RELAY_UNKNOWN_TOKEN
from kvstore.transport.http.auth import is_admin, is_bearer_unknown, require_admin, tenant_of
from kvstore.transport.http.query import query_bool

log = logging.getLogger("kvstore.fleet")

FLEET = web.AppKey("fleet", FleetNode)
FLEET_TIER = web.AppKey("fleet_tier", Tier)
TAKEOVER = web.AppKey("takeover", Takeover)
routes = web.RouteTableDef()


def adopted_store(app: web.Application, tenant: str, key: str) -> Store | None:
    """A dead node's store that holds ``key`` (takeover.py); None: none does, or not in a fleet."""
    takeover = app.get(TAKEOVER)
    return takeover.store_for(tenant, key) if takeover is not None else None


def with_adopted(app: web.Application, tenant: str, keys: list[str], present: list[bool]) -> list[bool]:
    """A lookup's ``present`` with the keys taken over from dead nodes."""
    takeover = app.get(TAKEOVER)
    return takeover.present(tenant, keys, present) if takeover is not None else present


def misplaced(app: web.Application, key: str) -> bool:
    """Whether a fleet node's writer would refuse a write of ``key`` (:func:`refuse_misplaced`)."""
    node = app.get(FLEET)
    return node is not None and node.placed_elsewhere(key) is not None


def refuse_misplaced(request: web.Request, keys: Iterable[str]) -> None:
    """Misdirected (421, the owner's URL in ``Kvstore-Owner``) for the first
    of ``keys`` a fleet node's writer does not own: a write stored here would
    be where the fleet never looks. Nothing off a fleet, or on a reader
    worker (writes are relayed to the writer, which checks), or when the
    client placed the keys by a newer membership than this node has seen
    (``Kvstore-Fleet-Version``: during a change, a node may still list a
    node the others have declared dead)."""
    node = request.app.get(FLEET)
    if node is None:
        return
    theirs = request.headers.get(FLEET_VERSION, "")
    if theirs.isdigit() and int(theirs) > node.view.version:
        return
    for key in keys:
        owner = node.placed_elsewhere(key)
        if owner is not None:
            raise Misdirected(
                f"key {key!r} is placed on {owner} by this fleet's membership (version {node.view.version}), "
                f"not on this node ({node.node_id}): write it there",
                owner,
            )


async def tenant_in_fleet(request: web.Request) -> str | None:
    """The tenant of the request's bearer token (:func:`tenant_of`); on a
    fleet node, a token it does not know may have been issued on another
    node since its registry's last check: the writer checks the fleet's
    registry now and looks again (401 only if it still does not know it); a
    reader worker answers None, and the request is relayed to its writer,
    which does that (:data:`RELAY_UNKNOWN_TOKEN`). Off a fleet: 401 at once."""
    try:
        return tenant_of(request)
    except Unauthorized:
        if is_bearer_unknown(request):
            node = request.app.get(FLEET)
            if node is not None:
                await node.confirm_registry()
                return tenant_of(request)
            if request.app.get(FOLLOWER) is not None:
                request[RELAY_UNKNOWN_TOKEN] = True
                return None
        raise


def fenced(app: web.Application) -> str:
    """Why this fleet node refuses writes ("" if it does not, or is not in a
    fleet): the writer worker's own view, or on a reader worker the writer's
    as it published it (kvstore/fleet/shared.py)."""
    node = app.get(FLEET)
    if node is not None:
        return node.fenced()
    follower = app.get(FOLLOWER)
    return follower.fenced() if follower is not None else ""


def tenants_fenced(app: web.Application) -> str:
    """Why this fleet node refuses tenant operations ("" if it does not): it
    cannot confirm the fleet's tenant registry (kvstore/fleet/node.py)."""
    node = app.get(FLEET)
    if node is not None:
        return node.tenants_fenced()
    follower = app.get(FOLLOWER)
    return follower.tenants_fenced() if follower is not None else ""


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
