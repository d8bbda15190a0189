"""The HTTP application: middlewares, health, metrics, and start-up/shutdown.

Start-up and shutdown live in one ordered place (``cleanup_ctx``): the store
opens (running recovery) before the first request is accepted and closes,
draining its write queues, after the last in-flight request has finished.
Errors are mapped to ``{"error": {"code", "message"}}`` bodies in one place.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from kvstore.errors import ExpectationFailed, InvalidRange, KVStoreError, Overloaded, Unauthorized, WriterTimeout
from kvstore.names import PATH_PARAMS
from kvstore.server_config import ServerConfig
from kvstore.tasks import Background
from kvstore.transport.http import internal, metrics
from kvstore.transport.http.bodies import BAD_BODY_FRAMING, BUDGET, BodyBudget
from kvstore.transport.http.common import (
    CONFIG,
    EXPECT,
    METRICS,
    STATE,
    STORE,
    client_gone,
    error_body,
    error_response,
    is_admin,
    require_admin,
    route_of,
    tenant_of,
)
from kvstore.transport.http.forward import WRITER, end_relayed_streams, forward, relayed, watch_writer
from kvstore.transport.http.routes import admin, batch, blocks, events, plans, records, xfer

log = logging.getLogger("kvstore.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_UNMETERED = {"/healthz", "/readyz", "/metrics", "/_internal/touches", "/_internal/leases", "/_internal/leases/release"}
_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "body_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    417: "expectation_failed",
    431: "headers_too_large",
}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@web.middleware
async def continue_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: a request that announced its body (``Expect: 100-continue``)
    and was answered without a ``100`` (refused at the gate, unmatched,
    overloaded) may still send that body or may never send it: its connection
    cannot carry another request, so it closes after the answer (RFC 9110
    §10.1.1) instead of waiting for a body to discard."""
    resp = await handler(request)
    if EXPECT in request and not request.content.is_eof():
        resp.force_close()
    return resp


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: counts every answer by the status the client gets (errors
    are already mapped to responses inside), and bounds requests in flight."""
    route = route_of(request)
    if route in _UNMETERED:
        return await handler(request)
    state = request.app[STATE]
    metrics = request.app[METRICS]
    t0 = time.perf_counter()
    if state["inflight"] >= request.app[CONFIG].max_concurrency:
        e = Overloaded(f"over {request.app[CONFIG].max_concurrency} requests in flight; retry")
        metrics.inc("kvstore_errors_total", code=e.code)
        metrics.inc("kvstore_http_requests_total", route=route, method=request.method, status=str(e.status))
        return error_response(e, {"Retry-After": "1"})
    state["inflight"] += 1
    status = "disconnected"  # what is left when the handler ends without a response
    try:
        resp = await handler(request)
        status = str(resp.status)
        return resp
    finally:
        state["inflight"] -= 1
        metrics.inc("kvstore_http_requests_total", route=route, method=request.method, status=status)
        metrics.observe("kvstore_http_request_seconds", time.perf_counter() - t0, route=route, method=request.method)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes a JSON body, in one place. A client that went away
    mid-answer is counted, not logged as a failure."""
    try:
        return await handler(request)
    except KVStoreError as e:
        headers: dict[str, str] = {}
        if isinstance(e, InvalidRange):
            headers["Content-Range"] = f"bytes */{e.size}"
        if isinstance(e, Unauthorized):
            headers["WWW-Authenticate"] = 'Bearer realm="kvstore"'
        if isinstance(e, Overloaded):
            headers["Retry-After"] = "1"
        if e.status >= 500:
            if isinstance(e, WriterTimeout):  # slow, not down: the writer may still complete it
                log.warning("%s %s: %s", request.method, route_of(request), e)
            elif not isinstance(e, Overloaded):  # counted, not logged: a flood must not flood the log
                log.error("%s %s: %s", request.method, route_of(request), e)
            request.app[METRICS].inc("kvstore_errors_total", code=e.code)
        return error_response(e, headers)
    except RequestPayloadError:
        # aiohttp could not decode the body (chunked framing, content coding);
        # its message quotes the bytes, so it is not passed on.
        return web.json_response(error_body("bad_request", BAD_BODY_FRAMING), status=400)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = _HTTP_CODES.get(e.status, "http_error")
        return web.json_response(
            error_body(code, e.reason),
            status=e.status,
            headers={"Allow": e.headers["Allow"]} if "Allow" in e.headers else None,
        )
    except ConnectionError:
        if not client_gone(request):
            raise_internal(request)
            raise
        request.app[METRICS].inc("kvstore_http_client_disconnects_total", route=route_of(request))
        log.debug("%s %s: the client disconnected", request.method, route_of(request))
        raise
    except Exception:  # noqa: BLE001 - the one place an unexpected failure becomes a 500
        raise_internal(request)
        return web.json_response(error_body("internal", "internal error"), status=500)


def raise_internal(request: web.Request) -> None:
    """Log and count an unexpected failure (the traceback goes to the log)."""
    log.exception("%s %s failed", request.method, route_of(request))
    request.app[METRICS].inc("kvstore_errors_total", code="internal")


ADMIN_OR_TENANT = frozenset({"/v1/events"})  # a tenant's token, or the admin's for every tenant


@web.middleware
async def gate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The same checks, in the same order, on every worker, before a route is
    answered or relayed: the token (admin for /v1/admin, else a tenant's),
    then every path parameter, then ``Expect`` (a ``100 Continue`` only for
    a request that passed the rest). Unmatched paths pass through to their
    404/405."""
    if request.match_info.http_exception is None:
        route = route_of(request)
        if route.startswith("/v1/admin/"):
            require_admin(request)
        elif route in ADMIN_OR_TENANT:
            if not is_admin(request):
                tenant_of(request)
        elif route.startswith("/v1/"):
            tenant_of(request)
        for name, value in request.match_info.items():
            PATH_PARAMS[name](value)
        if EXPECT in request:
            await _answer_expect(request)
    return await handler(request)


async def _answer_expect(request: web.Request) -> None:
    """RFC 9110 §10.1.1: ``100-continue`` (any case) gets a ``100 Continue``
    when a body is to come, over HTTP/1.1 (an HTTP/1.0 client sends its body
    anyway: the expectation is ignored); any other expectation is ``417``."""
    if request[EXPECT].strip(" \t").lower() != "100-continue":
        raise ExpectationFailed("the only expectation served is 100-continue")
    if request.version == aiohttp.HttpVersion11 and request.body_exists and not request.content.is_eof():
        await request.writer.write(CONTINUE)
    del request[EXPECT]  # met (or ignored): the body may be read


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "role": request.app[STATE]["role"], "pid": os.getpid()})


async def readyz(request: web.Request) -> web.Response:
    """Ready or not, to anyone (a load balancer's probe); the recovery report,
    which names tenants and segments, only with the admin token."""
    if not request.app[STATE]["ready"]:
        return web.json_response(error_body("not_ready", "the store is not open"), status=503)
    if is_admin(request):
        return web.json_response({"status": "ready", "recovery": request.app[STORE].recovery.as_dict()})
    return web.json_response({"status": "ready"})


@web.middleware
async def forward_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if relayed(request):
        return await forward(request)
    return await handler(request)


def make_app(
    config: ServerConfig, master: MasterKey, role: str = "single", writer_socket: str | None = None
) -> web.Application:
    """The application. ``role``: "single" (the only process), "writer" (owns
    the writes of a multi-worker daemon) or "reader" (serves reads, forwards
    writes to the writer listening on ``writer_socket``)."""
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
    }
    app[BUDGET] = BodyBudget(config.max_buffered_body_bytes)

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

    app.cleanup_ctx.append(store_ctx)
    app.cleanup_ctx.append(metrics.metrics_ctx)
    app.cleanup_ctx.append(plans.plans_ctx)
    if not reader:  # one NIXL agent and one event bus, the writer's: readers relay to them
        app.cleanup_ctx.append(events.events_ctx)
        app.cleanup_ctx.append(xfer.xfer_ctx)
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
    app.router.add_routes(records.routes)
    app.router.add_routes(xfer.routes)
    app.router.add_routes(events.routes)
    if role == "writer":
        app.router.add_routes(internal.routes)
    return app
