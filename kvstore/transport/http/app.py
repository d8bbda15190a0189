"""The HTTP application: its middlewares in order, health, routes, and start-up/shutdown.

Start-up and shutdown live in one ordered place (``cleanup_ctx``): the store
opens (running recovery) before the first request is accepted and closes,
draining its write queues, after the last in-flight request has finished.
Errors are mapped to ``{"error": {"code", "message"}}`` bodies in one place
(``middleware.errors_middleware``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from kvstore.engine.api import MasterKey, Store
from kvstore.server_config import ServerConfig
from kvstore.tasks import Background
from kvstore.transport.http import internal, metrics
from kvstore.transport.http.appkeys import CONFIG, METRICS, STATE, STORE
from kvstore.transport.http.auth import is_admin
from kvstore.transport.http.bodies import BUDGET, BodyBudget
from kvstore.transport.http.forward import WRITER, end_relayed_streams, watch_writer
from kvstore.transport.http.middleware import (
    continue_middleware,
    errors_middleware,
    forward_middleware,
    gate_middleware,
    metrics_middleware,
)
from kvstore.transport.http.qos import QOS, qos_ctx
from kvstore.transport.http.respond import error_body
from kvstore.transport.http.routes import admin, batch, blocks, events, fleet, plans, records, write_plans, xfer
from kvstore.transport.http.shares import SLOTS, TenantSlots

log = logging.getLogger("kvstore.http")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "role": request.app[STATE]["role"], "pid": os.getpid()})


async def readyz(request: web.Request) -> web.Response:
    """Ready or not, to anyone (a load balancer's probe); the recovery report,
    which names tenants and segments, only with the admin token."""
    if not request.app[STATE]["ready"]:
        return web.json_response(error_body("not_ready", "the store is not open"), status=503)
    why = fleet.fenced(request.app)
    if why:
        return web.json_response(error_body("fenced", f"this node refuses writes: {why}"), status=503)
    if is_admin(request):
        return web.json_response({"status": "ready", "recovery": request.app[STORE].recovery.as_dict()})
    return web.json_response({"status": "ready"})


def make_app(
    config: ServerConfig,
    master: MasterKey,
    role: str = "single",
    writer_socket: str | None = None,
    qos_table: int | None = None,
) -> web.Application:
    """The application. ``role``: "single" (the only process), "writer" (owns
    the writes of a multi-worker daemon) or "reader" (serves reads, forwards
    writes to the writer listening on ``writer_socket``). ``qos_table``: the
    workers' shared QoS buckets (:func:`kvstore.qos.buckets.shared_table`);
    None: this process's own."""
    reader = role == "reader"
    if role not in ("single", "writer", "reader"):
        raise ValueError(f"role={role!r}: expected single, writer or reader")
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
    app[STATE] = {
        "ready": False,
        "inflight": 0,
        "role": role,
        "writer_socket": writer_socket,
        "released_leases": [],
        "qos_table": qos_table,
    }
    app[BUDGET] = BodyBudget(config.max_buffered_body_bytes, config.store.max_block_size)
    app[SLOTS] = TenantSlots(config.max_concurrency)

    async def store_ctx(app: web.Application) -> AsyncIterator[None]:
        store = await (Store.open_reader if reader else Store.open)(config.store, master)
        app[STORE] = store
        app[METRICS] = store.metrics
        app[STATE]["ready"] = True
        log.info("store open at %s: %s", config.store.data_dir, store.recovery.as_dict())
        yield
        app[STATE]["ready"] = False
        await store.close()
        log.info("store closed")

    async def not_ready_on_shutdown(app: web.Application) -> None:
        app[STATE]["ready"] = False

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

    if not reader:
        app.cleanup_ctx.append(fleet.fleet_open_ctx(master))
    app.cleanup_ctx.append(store_ctx)
    app.cleanup_ctx.append(qos_ctx)

    async def weights_ctx(app: web.Application) -> AsyncIterator[None]:
        # Each tenant's share of the body budget and the requests in flight follows its QoS weight.
        app[BUDGET].weight_of = app[SLOTS].weight_of = app[QOS].weight
        yield

    app.cleanup_ctx.append(weights_ctx)
    app.cleanup_ctx.append(metrics.metrics_ctx)
    app.cleanup_ctx.append(plans.plans_ctx)
    if not reader:  # one NIXL agent and one event bus, the writer's: readers relay to them
        app.cleanup_ctx.append(events.events_ctx)
        app.cleanup_ctx.append(xfer.xfer_ctx)
        # Joins once the store and its event bus are up (a takeover tells its blocks).
        app.cleanup_ctx.append(fleet.fleet_join_ctx(master))
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
