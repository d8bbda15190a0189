"""The middlewares every request passes, outermost first: ``continue_middleware``
(a refused ``Expect: 100-continue`` closes its connection), ``metrics_middleware``
(counts answers, bounds requests in flight), ``errors_middleware`` (every error
becomes a ``{"error": {"code", "message"}}`` body, in one place),
``gate_middleware`` (token, path parameters, then ``Expect``, on every worker),
and on a reader ``forward_middleware`` (writes relayed to the writer).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from kvstore_client.wire.headers import OWNER as OWNER_HEADER

from kvstore.errors import (
    ExpectationFailed,
    Fenced,
    InvalidRange,
    KVStoreError,
    Misdirected,
    Overloaded,
    RateLimited,
    Unauthorized,
    UnsupportedMediaType,
    WriterTimeout,
)
from kvstore.names import PATH_PARAMS
from kvstore.transport.http.appkeys import EXPECT, METRICS, client_gone, route_of
from kvstore.transport.http.auth import is_admin, require_admin
from kvstore.transport.http.bodies import BAD_BODY_FRAMING
from kvstore.transport.http.forward import UNCOUNTED, WRITER, forward, relayed
from kvstore.transport.http.internal import on_private_socket
from kvstore.transport.http.qos import ADMISSION, BULK, TICKET
from kvstore.transport.http.respond import error_body, error_response
from kvstore.transport.http.routes.fleet import refuse_misplaced, tenant_in_fleet
from kvstore.transport.statuses import http_status

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


def relayed_to_me(request: web.Request) -> bool:
    """Whether a reader worker relayed ``request`` to this one, the writer
    (it came over the workers' private socket): the reader, which the client
    sent it to, counts it (kvstore_http_requests_total, the tenant's
    requests), so this worker does not count it again. (A relayed request
    used to count on both: twice in the daemon's /metrics.)"""
    return on_private_socket(request)


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: counts every answer by the status the client gets (errors
    are already mapped to responses inside), where the client sent it (not
    a relay: :func:`relayed_to_me`), and bounds requests in flight."""
    route = route_of(request)
    if route in _UNMETERED:
        return await handler(request)
    admission = request.app[ADMISSION]
    metrics = request.app[METRICS]
    counted = not relayed_to_me(request)
    t0 = time.perf_counter()
    try:
        admission.begin()
    except Overloaded as e:
        metrics.inc("kvstore_errors_total", code=e.code)
        if counted:
            status = str(http_status(e))
            metrics.inc("kvstore_http_requests_total", route=route, method=request.method, status=status)
        return error_response(e, {"Retry-After": "1"})
    status = "disconnected"  # what is left when the handler ends without a response
    try:
        resp = await handler(request)
        status = str(resp.status)
        return resp
    finally:
        admission.end()
        if counted:
            metrics.inc("kvstore_http_requests_total", route=route, method=request.method, status=status)
            seconds = time.perf_counter() - t0
            metrics.observe("kvstore_http_request_seconds", seconds, route=route, method=request.method)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes a JSON body, in one place. A client that went away
    mid-answer is counted, not logged as a failure."""
    try:
        return await handler(request)
    except KVStoreError as e:
        return error_response(e, error_answered(request.app, request.method, route_of(request), e))
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


def error_answered(app: web.Application, method: str, route: str, e: KVStoreError) -> dict[str, str]:
    """The headers an error's answer carries; a server error (5xx) is
    counted and logged here. One place for the route's answers and the fast lane's."""
    headers: dict[str, str] = {}
    if isinstance(e, InvalidRange):
        headers["Content-Range"] = f"bytes */{e.size}"
    if isinstance(e, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="kvstore"'
    if isinstance(e, Misdirected):
        headers[OWNER_HEADER] = e.owner
    if isinstance(e, RateLimited):
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after)))
    elif isinstance(e, Overloaded):
        headers["Retry-After"] = "1"
    if http_status(e) >= 500:
        if isinstance(e, WriterTimeout):  # slow, not down: the writer may still complete it
            log.warning("%s %s: %s", method, route, e)
        elif not isinstance(e, Overloaded | Fenced):  # counted, not logged: a flood must not flood the log
            # (a fenced node says why once, as it fences and as it lifts the fence: kvstore/fleet/node.py)
            log.error("%s %s: %s", method, route, e)
        app[METRICS].inc("kvstore_errors_total", code=e.code)
    return headers


def raise_internal(request: web.Request) -> None:
    """Log and count an unexpected failure (the traceback goes to the log)."""
    log.exception("%s %s failed", request.method, route_of(request))
    request.app[METRICS].inc("kvstore_errors_total", code="internal")


ADMIN_OR_TENANT = frozenset({"/v1/events", "/v1/fleet"})  # a tenant's token, or the admin's
# Writes of one key named in the path; the batch, write-plan and NIXL writes check their keys themselves.
PLACED_WRITES = frozenset({("PUT", "/v1/blocks/{key}"), ("DELETE", "/v1/blocks/{key}")})


def refuse_content_coding(request: web.Request) -> None:
    """A request body is taken as sent, on every path and worker: one in a
    content coding (``Content-Encoding`` other than ``identity``) is refused
    with 415 before it is read. (aiohttp would decode gzip, deflate and br
    bodies, and the fast lane stored them as sent: the bytes stored depended
    on the path.) Blocks are compressed by the store, per tenant."""
    coding = request.headers.get("Content-Encoding")
    if coding is not None and request.body_exists and coding.strip(" \t").lower() != "identity":
        raise UnsupportedMediaType(
            "header 'Content-Encoding': request bodies in a content coding are not accepted; "
            "send them as they are (the store compresses blocks itself)"
        )


@web.middleware
async def gate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The same checks, in the same order, on every worker, before a route is
    answered or relayed: the token (admin for /v1/admin, else a tenant's),
    then every path parameter, the tenant's share of requests in flight
    (shares.py), then ``Expect`` (a ``100 Continue`` only for a request that
    passed the rest). Unmatched paths pass through to their 404/405."""
    tenant = None
    matched = request.match_info.http_exception is None
    if matched:
        route = route_of(request)
        if route.startswith("/v1/admin/"):
            require_admin(request)
        elif route in ADMIN_OR_TENANT:
            if not is_admin(request):
                tenant = await tenant_in_fleet(request)
        elif route.startswith("/v1/"):
            tenant = await tenant_in_fleet(request)
        for name, value in request.match_info.items():
            PATH_PARAMS[name](value)
        refuse_content_coding(request)
        if (request.method, route) in PLACED_WRITES:  # a fleet node's writer stores only its own keys
            refuse_misplaced(request, [request.match_info["key"]])
    if tenant is None:
        if matched and EXPECT in request:
            await _answer_expect(request)
        return await handler(request)
    # Its admission (kvstore/qos/admission.py): its share of the worker's
    # requests in flight, held until the answer (no tenant can take every
    # slot), a request of its QoS, and for a bulk read a slot of the fair
    # gate. A relayed request is the writer's to limit, and the reader's to
    # count (unless it did not know the token: forward.UNCOUNTED).
    limited = not (WRITER in request.app and relayed(request))
    bulk = (request.method, route_of(request)) in BULK
    counted = not relayed_to_me(request) or request.headers.get(UNCOUNTED) == "tenant"
    ticket = await request.app[ADMISSION].enter(tenant, limited=limited, bulk=bulk, counted=counted)
    request[TICKET] = ticket
    try:
        if EXPECT in request:
            await _answer_expect(request)
        return await handler(request)
    finally:
        ticket.close()


async def _answer_expect(request: web.Request) -> None:
    """RFC 9110 §10.1.1: ``100-continue`` (any case) gets a ``100 Continue``
    when a body is to come, over HTTP/1.1 (an HTTP/1.0 client sends its body
    anyway: the expectation is ignored); any other expectation is ``417``."""
    if request[EXPECT].strip(" \t").lower() != "100-continue":
        raise ExpectationFailed("the only expectation served is 100-continue")
    if request.version == aiohttp.HttpVersion11 and request.body_exists and not request.content.is_eof():
        await request.writer.write(CONTINUE)
    del request[EXPECT]  # met (or ignored): the body may be read


@web.middleware
async def forward_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if relayed(request):
        return await forward(request)
    return await handler(request)
