"""The HTTP application of a node: the transport (kvstore/transport/http/)
over a node opened here (node.py), with what its routes use put on it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from kvstore.daemon.node import Node, Shared, open_node
from kvstore.engine.api import MasterKey
from kvstore.server_config import ServerConfig
from kvstore.transport.http.app import http_app
from kvstore.transport.http.appkeys import FOLLOWER, METRICS, STORE
from kvstore.transport.http.internal import BELL, RINGER
from kvstore.transport.http.qos import ADMISSION
from kvstore.transport.http.routes.events import EVENTS
from kvstore.transport.http.routes.fleet import FLEET, FLEET_TIER, TAKEOVER
from kvstore.transport.http.routes.xfer import XFER

NODE = web.AppKey("node", Node)


def make_app(
    config: ServerConfig,
    master: MasterKey,
    role: str = "single",
    writer_socket: str | None = None,
    shared: Shared | None = None,
) -> web.Application:
    """The HTTP application of a process of ``role`` ("single": the only
    process; "writer": owns the writes of a multi-worker daemon; "reader":
    serves reads, forwards writes to the writer listening on
    ``writer_socket``), its node opened on start-up and closed last.
    ``shared``: what the workers of one daemon share (node.Shared)."""

    async def node_ctx(app: web.Application) -> AsyncIterator[None]:
        async with open_node(config, master, role, shared) as node:
            attach(app, node)
            yield

    if role not in ("single", "writer", "reader"):
        raise ValueError(f"role={role!r}: expected single, writer or reader")
    return http_app(config, node_ctx, role, writer_socket)


def attach(app: web.Application, node: Node) -> None:
    """What the HTTP routes take from the node, on the application."""
    app[NODE] = node
    app[STORE] = node.store
    app[METRICS] = node.store.metrics
    app[ADMISSION] = node.admission
    if node.events is not None:
        app[EVENTS] = node.events
    if node.xfer is not None:
        app[XFER] = node.xfer
    if node.fleet is not None and node.takeover is not None:
        app[FLEET] = node.fleet
        app[TAKEOVER] = node.takeover
    if node.fleet_tier is not None:
        app[FLEET_TIER] = node.fleet_tier
    if node.follower is not None:
        app[FOLLOWER] = node.follower
    if node.ringer is not None:
        app[RINGER] = node.ringer
    if node.bell is not None:
        app[BELL] = node.bell
