"""The HTTP application: its middlewares in order, health, routes, and this
transport's start-up and shutdown, over a node it is handed.

Start-up and shutdown live in one ordered place (``cleanup_ctx``): the node
opens first (the store, running recovery, before the first request is
accepted: kvstore/daemon/node.py) and closes last, draining its write
queues, after the last in-flight request has finished.
Errors are mapped to ``{"error": {"code", "message"}}`` bodies in one place
(``middleware.errors_middleware``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.server_config import ServerConfig
from kvstore.tasks import Background
from kvstore.transport.http import internal, metrics
from kvstore.transport.http.appkeys import CONFIG, STATE, STORE
from kvstore.transport.http.auth import is_admin
from kvstore.transport.http.forward import WRITER, end_relayed_streams, watch_writer
from kvstore.transport.http.middleware import (
    continue_middleware,
    errors_middleware,
    forward_middleware,
    gate_middleware,
    metrics_middleware,
)
from kvstore.transport.http.qos import ADMISSION
from kvstore.transport.http.respond import error_body
from kvstore.transport.http.routes import admin, batch, blocks, events, fleet, plans, records, write_plans, xfer

log = logging.getLogger("kvstore.http")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "role": request.app[STATE]["role"], "pid": os.getpid()})


async def readyz(request: web.Request) -> web.Response:
    """Ready or not, to anyone (a load balancer's probe); the recovery report,
    which names tenants and segments, only with the admin token."""
    if ADMISSION not in request.app or not request.app[ADMISSION].ready:
        return web.json_response(error_body("not_ready", "the store is not open"), status=503)
    why = fleet.fenced(request.app)
    if why:
        return web.json_response(error_body("fenced", f"this node refuses writes: {why}"), status=503)
    why = fleet.tenants_fenced(request.app)
    if why:
        return web.json_response(error_body("fenced", f"this node refuses tenant operations: {why}"), status=503)
    doc: dict[str, Any] = {"status": "ready"}
    tier = await object_tier_state(request.app)
    if tier is not None and not tier["reachable"]:
        # Still ready: the node serves its local data, and uploads once the tier answers.
        doc["object_tier"] = tier if is_admin(request) else {"reachable": False, "since": tier["since"]}
    if is_admin(request):
        doc["recovery"] = request.app[STORE].recovery.as_dict()
    return web.json_response(doc)


async def object_tier_state(app: web.Application) -> dict[str, Any] | None:
    """Whether the node's object tier answers (``Store.object_tier_state``):
    the writer's (or the only process's) own view; a reader worker, which
    uploads nothing, reads it from the writer's metrics snapshot. None: no
    object tier, or nothing known yet."""
    store = app[STORE]
    own = store.object_tier_state()
    if own is not None or app[STATE]["role"] != "reader":
        return own
    gauges = await asyncio.to_thread(
        metrics.writers_gauges, app, "kvstore_tier_reachable", "kvstore_tier_unreachable_since_seconds"
    )
    if "kvstore_tier_reachable" not in gauges:
        return None
    if gauges["kvstore_tier_reachable"]:
        return {"reachable": True}
    return {"reachable": False, "since": gauges.get("kvstore_tier_unreachable_since_seconds", 0.0)}


NodeContext = Callable[[web.Application], AsyncIterator[None]]


def http_app(
    config: ServerConfig,
    node_ctx: NodeContext,
    role: str = "single",
    writer_socket: str | None = None,
) -> web.Application:
    """The HTTP application over a node: ``node_ctx`` opens the node (the
    composition root's, kvstore/daemon/app.py) and puts what the routes use
    on the application (the store, its metrics, the admission, the event
    bus, the NIXL agent, the fleet) before any of this transport's own
    start-up runs. ``role``: "single" (the only process), "writer" (owns the
    writes of a multi-worker daemon) or "reader" (serves reads, forwards
    writes to the writer listening on ``writer_socket``)."""
    reader = role == "reader"
    if reader and not writer_socket:
        raise ValueError("a reader needs the writer's socket")
    app = web.Application(
        middlewares=[
            continue_middleware,
            metrics_middleware,
            errors_middleware,
            gate_middleware,
            *([forward_middleware] if reader else []),
        ],
        client_max_size=4 << 20,  # JSON bodies (lookup, batch get); block bodies are streamed
    )
    app[CONFIG] = config
    # writer_socket: the workers' private socket; /_internal/ answers there only.
    # released_leases: read plans' leases a reader released, for the writer (internal.relay).
    # started: monotonic, when this process made its app (the admin status's uptime_s; a
    # worker that dies takes the daemon down with it, so the writer's is the daemon's).
    app[STATE] = {
        "role": role,
        "writer_socket": writer_socket,
        "released_leases": [],
        "started": time.monotonic(),
    }

    async def not_ready_on_shutdown(app: web.Application) -> None:
        if ADMISSION in app:
            app[ADMISSION].ready = False

    async def writer_ctx(app: web.Application) -> AsyncIterator[None]:
        # One connection per relayed request in flight: aiohttp's default pool
        # of 100 would let 100 stalled uploads block every other relayed call.
        # max_concurrency already bounds what is in flight here (+1: the touches relay).
        connector = aiohttp.UnixConnector(path=str(writer_socket), limit=config.max_concurrency + 1)
        async with aiohttp.ClientSession(connector=connector) as session:
            app[WRITER] = session
            relay = Background()
            relay.spawn(internal.relay(app, session), "relay-to-writer")
            relay.spawn(watch_writer(app, str(writer_socket)), "watch-writer")
            yield
            await relay.close()

    app.cleanup_ctx.append(node_ctx)
    app.cleanup_ctx.append(metrics.metrics_ctx)
    app.cleanup_ctx.append(plans.plans_ctx)
    if reader:
        app.cleanup_ctx.append(writer_ctx)
    app.on_shutdown.append(not_ready_on_shutdown)
    app.on_shutdown.append(events.end_streams)
    if reader:
        app.on_shutdown.append(end_relayed_streams)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics.metrics)
    app.router.add_routes(blocks.routes)
    app.router.add_routes(batch.routes)
    app.router.add_routes(admin.routes)
    app.router.add_routes(plans.routes)
    app.router.add_routes(write_plans.routes)
    app.router.add_routes(records.routes)
    app.router.add_routes(xfer.routes)
    app.router.add_routes(events.routes)
    app.router.add_routes(fleet.routes)
    if role == "writer":
        app.router.add_routes(internal.routes)
    return app
