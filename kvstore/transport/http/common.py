"""What every HTTP route shares: app keys, auth, error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
import socket
import struct
from typing import Any

from aiohttp import web

from kvstore.engine.store import Store
from kvstore.errors import InvalidInput, KVStoreError, Unauthorized
from kvstore.metrics import Metrics
from kvstore.server_config import ServerConfig

STORE = web.AppKey("store", Store)
CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)
STATE = web.AppKey("state", dict[str, Any])
BATCH_TYPE = "application/x-kvstore-batch"
# The request's Expect header, taken from aiohttp by the connection layer
# (connection.KVAppRunner) and answered by the gate (app.gate_middleware).
EXPECT = web.RequestKey("expect", str)


def store_of(request: web.Request) -> Store:
    return request.app[STORE]


def config_of(request: web.Request) -> ServerConfig:
    return request.app[CONFIG]


def route_of(request: web.Request) -> str:
    """The matched route's pattern (``/v1/blocks/{key}``), or "unmatched"."""
    info = request.match_info
    resource = info.route.resource if info.route is not None else None
    return resource.canonical if resource is not None else "unmatched"


def client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed or closing."""
    transport = request.transport
    return transport is None or transport.is_closing()


SEND_PIECE = 1 << 20


async def send(request: web.Request, resp: web.StreamResponse, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to a prepared response in pieces of SEND_PIECE bytes,
    each taken by the client within request_timeout_s. A client that stops
    reading is cut off (its connection aborted, counted as a disconnect)
    instead of holding its slot and the block's buffer for ever."""
    seconds = config_of(request).request_timeout_s
    view = memoryview(data).cast("B")
    for at in range(0, len(view), SEND_PIECE) if len(view) else (0,):
        try:
            async with asyncio.timeout(seconds):
                await resp.write(view[at : at + SEND_PIECE])
        except TimeoutError:
            reset_connection(request)
            raise ConnectionResetError(f"the client read nothing for {seconds} s") from None


def reset_connection(request: web.Request) -> None:
    """Abort the connection with a RST: the kernel drops what it still holds
    for the client instead of trying to deliver it after the close."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip(" \t")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    # Tokens are visible ASCII (RFC 6750's b64token is a subset); anything else
    # cannot name a tenant. Never echo it: it may be a secret with a typo.
    if not token.isascii() or not token.isprintable() or " " in token:
        raise Unauthorized("malformed bearer token: expected visible ASCII characters")
    return token


_TENANT = web.RequestKey("tenant", str)


def tenant_of(request: web.Request) -> str:
    """The tenant named by the request's bearer token (401 when none)."""
    cached: str | None = request.get(_TENANT)
    if cached is not None:
        return cached
    tenant = store_of(request).authenticate(_bearer(request))
    if tenant is None:
        raise Unauthorized("unknown or revoked token")
    request[_TENANT] = tenant
    return tenant


def require_admin(request: web.Request) -> None:
    secret = config_of(request).admin_secret()
    token = _bearer(request)
    # Compare fixed-length digests in constant time: no early exit, no length leak.
    if secret is None or not hmac.compare_digest(_digest(token), _digest(secret)):
        raise Unauthorized("admin token required")


def is_admin(request: web.Request) -> bool:
    """Whether the request carries the admin token (never raises)."""
    try:
        require_admin(request)
    except Unauthorized:
        return False
    return True


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def error_response(e: KVStoreError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(e.code, str(e)), status=e.status, headers=headers)


LEASE_S = 30.0  # default lease of a read plan
MAX_LEASE_S = 600.0


def lease_field(body: dict[str, Any], default: float = LEASE_S) -> float:
    """A request's ``lease_s``: seconds in (0, MAX_LEASE_S]."""
    value = body.get("lease_s", default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LEASE_S:
        raise InvalidInput(f"field 'lease_s' must be a number of seconds in (0, {MAX_LEASE_S:g}]; got {value!r}")
    return float(value)


# Query parameters (RFC 3986 §3.4), typed as docs/openapi.yaml describes them,
# read strictly: a value of the wrong type, out of range, or a parameter given
# twice is a 400 naming it, never silently read as something else (int()
# and float() would take " 5", "+5", "5_0", Arabic-Indic digits, "1e3", "nan").
_DECIMAL = re.compile(r"[0-9]{1,18}")
_NUMBER = re.compile(r"[0-9]{1,18}(\.[0-9]{1,9})?")
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")


def query_value(request: web.Request, name: str) -> str | None:
    """The query parameter ``name`` (None when absent); 400 if given twice."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise InvalidInput(f"query parameter {name!r} is given {len(values)} times; give it once")
    return values[0] if values else None


def query_int(request: web.Request, name: str, lo: int, hi: int) -> int | None:
    """An integer query parameter: decimal ASCII digits, from ``lo`` to
    ``hi``; None when absent."""
    raw = query_value(request, name)
    if raw is None:
        return None
    if not _DECIMAL.fullmatch(raw) or not lo <= int(raw) <= hi:
        raise InvalidInput(f"query parameter {name!r} must be an integer from {lo} to {hi}")
    return int(raw)


def query_number(request: web.Request, name: str, lo: float, hi: float, default: float) -> float:
    """A number query parameter: decimal ASCII digits with an optional
    fraction (``2``, ``0.5``), from ``lo`` to ``hi``."""
    raw = query_value(request, name)
    if raw is None:
        return default
    if not _NUMBER.fullmatch(raw) or not lo <= float(raw) <= hi:
        raise InvalidInput(f"query parameter {name!r} must be a number from {lo:g} to {hi:g}, such as 2 or 0.5")
    return float(raw)


def query_bool(request: web.Request, name: str, default: bool) -> bool:
    """A boolean query parameter: 1, true, yes or 0, false, no (any case)."""
    raw = query_value(request, name)
    if raw is None:
        return default
    if raw.lower() not in TRUE + FALSE:
        raise InvalidInput(f"query parameter {name!r} must be one of {', '.join(TRUE + FALSE)}")
    return raw.lower() in TRUE
