"""Admin routes (admin token): tenants, tokens, key rotation, flush, scrub, status."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvstore import __commit__, __version__
from kvstore.config import DURABILITY_CLASSES
from kvstore.engine.api import DEFAULT_ADMIT_WINDOW_S, load_master_key
from kvstore.errors import InvalidInput, MasterKeyError, TenantNotFound
from kvstore.metrics import Metrics
from kvstore.names import validate_tenant
from kvstore.qos.policy import parse_qos
from kvstore.redaction import SCRUBBER
from kvstore.transport.http.appkeys import FOLLOWER, STATE, config_of, store_of
from kvstore.transport.http.auth import require_admin
from kvstore.transport.http.bodies import json_body
from kvstore.transport.http.metrics import whole
from kvstore.transport.http.qos import ADMISSION
from kvstore.transport.http.query import query_bool, query_number, query_value
from kvstore.transport.http.routes.fleet import FLEET, fenced, tenants_fenced
from kvstore.transport.http.routes.xfer import XFER
from kvstore.transport.nixl.devices import discover

routes = web.RouteTableDef()
FLUSH_TIMEOUT_S = 600
MAX_FLUSH_TIMEOUT_S = 86_400
# On a fleet node, every answer to an admin change of the tenant registry names
# the revision of the fleet's registry this node holds once the change is done:
# at least the revision the change wrote. Each node's GET /v1/admin/status says
# the revision it holds (fleet.registry_revision): once every alive member's is
# at least this one, the change is in force on all of them (kvstore admin --wait).
REVISION_HEADER = "Kvstore-Registry-Revision"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def registry_change(handler: Handler) -> Handler:
    """A route that changes the tenant registry: its answer carries
    :data:`REVISION_HEADER` on a fleet node."""

    @functools.wraps(handler)
    async def answered(request: web.Request) -> web.StreamResponse:
        response = await handler(request)
        node = request.app.get(FLEET)
        if node is not None:
            response.headers[REVISION_HEADER] = str(node.registry_version)
        return response

    return answered


@routes.post("/v1/admin/tenants")
@registry_change
async def create_tenant(request: web.Request) -> web.Response:
    require_admin(request)
    body = await json_body(request)
    name, policy, compression = body.get("name"), body.get("policy", "sealed"), body.get("compression")
    durability = body.get("durability")
    if not isinstance(name, str):
        raise InvalidInput("field 'name' must be a string")
    if not isinstance(policy, str):
        raise InvalidInput("field 'policy' must be 'sealed' or 'direct'")
    if compression is not None and not isinstance(compression, str):
        raise InvalidInput("field 'compression' must be a string")
    if durability is not None and durability not in DURABILITY_CLASSES:
        raise InvalidInput(f"field 'durability' must be one of {', '.join(DURABILITY_CLASSES)}")
    unknown = set(body) - {"name", "policy", "compression", "durability", "events_topic", "qos", "eviction"}
    unknown -= {*LIMITS, *ADMIT_FIELDS}
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}")
    limits = _limits(body)
    qos = parse_qos(body["qos"]) if "qos" in body else None
    admit_after, admit_window_s = _admission(body)
    store = store_of(request)
    tenant = await store.create_tenant(
        name,
        policy,
        compression,
        durability,
        limits.get("quota_bytes"),
        limits.get("ttl_s"),
        limits.get("frame_size"),
        _topic(body),
        qos,
        admit_after,
        admit_window_s,
        eviction=_eviction(body),
    )
    token_id, token = await store.issue_token(name)
    # The tenant as it is now: its "tokens" list the one just issued (it was
    # read before, and answered "tokens": [] beside the token).
    tenant = store.tenant(name)
    return web.json_response({**tenant, "token": token, "token_id": token_id}, status=201)


def _rates(request: web.Request, name: str) -> dict[str, float]:
    """The tenant's node-wide rates over the last few seconds (kvstore/qos/admission.py)."""
    return request.app[ADMISSION].rates(name)


@routes.get("/v1/admin/tenants")
async def list_tenants(request: web.Request) -> web.Response:
    """Every tenant with its usage, as ``GET /v1/admin/tenants/{name}``
    answers it: the blocks and bytes are counters the index keeps per tenant
    (one read each, never a scan), the hits this node's counters."""
    require_admin(request)
    store = store_of(request)
    hits = _hits(await whole(request.app))
    out = []
    for tenant in store.tenants():
        try:
            out.append(await _with_usage(request, tenant, hits))
        except TenantNotFound:  # deleted since the list was taken
            continue
    return web.json_response({"tenants": out})


LIMITS = ("quota_bytes", "ttl_s", "frame_size")


def _limits(body: dict[str, Any]) -> dict[str, int]:
    """The limits a body sets: an integer, or null for none (0); absent ones
    are left out (unchanged, or the configured default at creation)."""
    out = {}
    for name in LIMITS:
        if name not in body:
            continue
        value = body[name]
        if value is None:
            out[name] = 0
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62:
            out[name] = value
        else:
            raise InvalidInput(f"field {name!r} must be a non-negative integer, or null for none; got {value!r}")
    return out


ADMIT_FIELDS = ("admit_after", "admit_window_s")


def _admission(body: dict[str, Any]) -> tuple[Any, Any]:
    """``admit_after`` and ``admit_window_s`` as the body sets them (null:
    1, every block stored; and DEFAULT_ADMIT_WINDOW_S), None where absent;
    the store checks them (400 naming the field)."""
    after, window = body.get("admit_after"), body.get("admit_window_s")
    if after is None and "admit_after" in body:
        after = 1
    if window is None and "admit_window_s" in body:
        window = DEFAULT_ADMIT_WINDOW_S
    return after, window


def _eviction(body: dict[str, Any]) -> str | None:
    """``eviction``: a policy's name, or null for the node's ("");
    None where absent (the store checks the name: 400 naming the field)."""
    if "eviction" not in body:
        return None
    value = body["eviction"]
    return "" if value is None else value


def _topic(body: dict[str, Any]) -> str | None:
    """``events_topic``: a string, or null for the tenant's name ("")."""
    value = body.get("events_topic")
    if value is None:
        return "" if "events_topic" in body else None
    if not isinstance(value, str):
        raise InvalidInput("field 'events_topic' must be a string, or null for the tenant's name")
    return value


HIT_COUNTERS = (("reads", "kvstore_tenant_reads_total"), ("prefix_blocks", "kvstore_tenant_prefix_blocks_total"))


def _hits(metrics: Metrics) -> dict[str, dict[str, dict[str, int]]]:
    """Each tenant's hits and misses since the daemon started, from the
    whole daemon's counters (every worker's): ``reads``, block reads that
    found the block or not; ``prefix_blocks``, the blocks of prefix lookups
    present from the chain's start or not (the engines' hit rate)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for kind, name in HIT_COUNTERS:
        for labels, value in metrics.counters(name):
            tenant, result = labels.get("tenant"), labels.get("result")
            if tenant is not None and result in ("hit", "miss"):
                out.setdefault(tenant, _no_hits())[kind][result] = int(value)
    return out


def _no_hits() -> dict[str, dict[str, int]]:
    return {kind: {"hit": 0, "miss": 0} for kind, _ in HIT_COUNTERS}


async def _with_usage(
    request: web.Request, tenant: dict[str, Any], hits: dict[str, dict[str, dict[str, int]]]
) -> dict[str, Any]:
    """A tenant as the store shows it, with its rates, its usage (the
    index's counters: one read) and its ``hits``."""
    name = tenant["name"]
    s = await store_of(request).stats(name)
    return {
        **tenant,
        "rates": _rates(request, name),
        "blocks": s.blocks,
        "bytes_stored": s.stored_bytes,
        "bytes_logical": s.logical_bytes,
        "hits": hits.get(name) or _no_hits(),
    }


async def _tenant_with_usage(request: web.Request, name: str) -> dict[str, Any]:
    tenant = store_of(request).tenant(name)
    return await _with_usage(request, tenant, _hits(await whole(request.app)))


@routes.get("/v1/admin/tenants/{name}")
async def get_tenant(request: web.Request) -> web.Response:
    require_admin(request)
    return web.json_response(await _tenant_with_usage(request, request.match_info["name"]))


@routes.patch("/v1/admin/tenants/{name}")
@registry_change
async def patch_tenant(request: web.Request) -> web.Response:
    """Change a tenant's ``quota_bytes``, ``ttl_s``, ``frame_size``,
    ``events_topic`` (null: none, the store's frame size, the tenant's name;
    absent: unchanged), ``qos`` fields (each named is changed; null: the
    store's default), ``admit_after`` and ``admit_window_s`` (null: 1, and
    the default window), ``eviction`` (null: the node's ``quota_eviction``).
    A lower quota is enforced in the background, started before the answer
    (``quota_enforcement``: the bytes over it); a QoS
    or admission change applies to the next request, on every worker."""
    require_admin(request)
    name = request.match_info["name"]
    body = await json_body(request)
    unknown = set(body) - {*LIMITS, "events_topic", "qos", "eviction", *ADMIT_FIELDS}
    changeable = "quota_bytes, ttl_s, frame_size, events_topic, qos, admit_after, admit_window_s and/or eviction"
    if unknown:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(unknown))}; PATCH changes {changeable}")
    if not body:
        raise InvalidInput(f"the body names nothing to change: expected {changeable}")
    limits = _limits(body)
    topic = _topic(body) if "events_topic" in body else None
    qos = parse_qos(body["qos"]) if "qos" in body else None
    admit_after, admit_window_s = _admission(body)
    changed = await store_of(request).set_limits(
        name,
        limits.get("quota_bytes"),
        limits.get("ttl_s"),
        limits.get("frame_size"),
        topic,
        qos,
        admit_after,
        admit_window_s,
        eviction=_eviction(body),
    )
    answer = await _tenant_with_usage(request, name)
    return web.json_response({**answer, "quota_enforcement": changed["quota_enforcement"]})


@routes.delete("/v1/admin/tenants/{name}")
@registry_change
async def delete_tenant(request: web.Request) -> web.Response:
    require_admin(request)
    await store_of(request).delete_tenant(request.match_info["name"])
    return web.Response(status=204)


@routes.post("/v1/admin/tenants/{name}/tokens")
@registry_change
async def issue_token(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    token_id, token = await store_of(request).issue_token(name)
    return web.json_response({"name": name, "token": token, "token_id": token_id}, status=201)


@routes.delete("/v1/admin/tenants/{name}/tokens/{token_id}")
@registry_change
async def revoke_token(request: web.Request) -> web.Response:
    require_admin(request)
    await store_of(request).revoke_token(request.match_info["name"], request.match_info["token_id"])
    return web.Response(status=204)


@routes.post("/v1/admin/tenants/{name}/s3-keys")
@registry_change
async def issue_s3_key(request: web.Request) -> web.Response:
    """An access key for the S3 gateway; the secret is shown once."""
    require_admin(request)
    name = request.match_info["name"]
    akid, secret = await store_of(request).issue_s3_key(name)
    return web.json_response({"name": name, "access_key_id": akid, "secret_access_key": secret}, status=201)


@routes.get("/v1/admin/tenants/{name}/s3-keys", allow_head=False)
async def list_s3_keys(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    tenant = store_of(request).tenant(name)
    return web.json_response({"name": name, "s3_keys": tenant["s3_keys"]})


@routes.delete("/v1/admin/tenants/{name}/s3-keys/{access_key_id}")
@registry_change
async def revoke_s3_key(request: web.Request) -> web.Response:
    require_admin(request)
    await store_of(request).revoke_s3_key(request.match_info["name"], request.match_info["access_key_id"])
    return web.Response(status=204)


@routes.post("/v1/admin/tenants/{name}/rotate-key")
@registry_change
async def rotate_tenant_key(request: web.Request) -> web.Response:
    require_admin(request)
    version = await store_of(request).rotate_tenant_key(request.match_info["name"])
    return web.json_response({"name": request.match_info["name"], "key_version": version})


@routes.post("/v1/admin/master-key")
async def rotate_master_key(request: web.Request) -> web.Response:
    """Rewrap every data key under the master key in ``key_file`` (a path on
    this host, mode 0600). Key material never travels in the request; point
    KVSTORE_MASTER_KEY_FILE at the new file before the next restart."""
    require_admin(request)
    body = await json_body(request)
    key_file = body.get("key_file")
    if not isinstance(key_file, str) or not key_file:
        raise InvalidInput("field 'key_file' must be the path of the new master key file")
    if "\x00" in key_file:
        raise InvalidInput("field 'key_file' contains a NUL character; expected a file path")
    try:
        new = load_master_key(key_file)
    except MasterKeyError as e:
        raise InvalidInput(f"key_file: {e}") from None
    except (OSError, ValueError) as e:  # read after the mode check, a path too long for the OS...
        raise InvalidInput(f"field 'key_file': the file cannot be read ({type(e).__name__})") from None
    SCRUBBER.add_key(new.secret)  # from now on, never printed in a log either
    await store_of(request).rotate_master_key(new, key_file)
    return web.json_response({"master_key_id": new.key_id})


@routes.post("/v1/admin/flush")
async def flush(request: web.Request) -> web.Response:
    """Seal the open segments; with an object tier, answer once every sealed
    segment is in it (or 503 flush_incomplete after ``timeout_s``, default 600)."""
    require_admin(request)
    timeout = query_number(request, "timeout_s", 0, MAX_FLUSH_TIMEOUT_S, FLUSH_TIMEOUT_S)
    report = await store_of(request).flush(upload_timeout_s=timeout)
    return web.json_response(report)


@routes.post("/v1/admin/compact")
async def compact(request: web.Request) -> web.Response:
    """Run a compaction pass now (``?tenant=NAME``: that tenant only) and
    answer with what it did once it is done."""
    require_admin(request)
    tenant = query_value(request, "tenant")
    if tenant is not None:
        validate_tenant(tenant)
    report = await store_of(request).compact(tenant)
    return web.json_response(report.as_dict())


@routes.post("/v1/admin/verify")
async def verify(request: web.Request) -> web.Response:
    require_admin(request)
    deep = query_bool(request, "deep", False)
    report = await store_of(request).verify(deep=deep)
    return web.json_response(report.as_dict(), status=200)


@routes.get("/v1/admin/status", allow_head=False)
async def status(request: web.Request) -> web.Response:
    """The build (``version``, ``commit``), the process that answers (the
    writer, with several workers: ``role``, ``pid``, ``uptime_s``) and how
    many ``workers`` the daemon runs, the data directory's ``disk`` as the
    store measures it, the object tier's ``upload_backlog`` (null without
    one) and whether it answers (``object_tier``: null without one; a node
    whose tier does not answer serves its local data), the ``fence`` (``{"fenced": false}`` off a fleet), the node's
    ``fleet`` (its id and the revision of the fleet's registry it holds;
    null off a fleet), its NIXL agent (``{"enabled": false}`` when ``nixl``
    is off) and the host's RDMA devices as pyverbs sees them (an empty list
    with the reason)."""
    require_admin(request)
    app, store = request.app, store_of(request)
    nixl = app[XFER].status() if XFER in app else {"enabled": False}
    found, disk = await asyncio.gather(asyncio.to_thread(discover), asyncio.to_thread(store.space))
    backlog = store.upload_backlog()
    node = app.get(FLEET)
    role = app[STATE]["role"]
    fleet = None
    if node is not None:
        fleet = {"node_id": node.node_id, "registry_revision": node.registry_version, "heartbeat_s": node.heartbeat_s}
    return web.json_response(
        {
            "version": __version__,
            "commit": __commit__,
            "role": role,
            "pid": os.getpid(),
            "workers": 1 if role == "single" else config_of(request).worker_count,
            "uptime_s": round(time.monotonic() - app[STATE]["started"], 3),
            "disk": disk,
            "upload_backlog": None if backlog is None else {"segments": backlog[0], "bytes": backlog[1]},
            "object_tier": store.object_tier_state(),
            "fence": _fence(app),
            "fleet": fleet,
            "nixl": nixl,
            "rdma": found.as_dict(),
        }
    )


def _fence(app: web.Application) -> dict[str, Any]:
    """Whether this node refuses writes (``fenced``) and tenant operations
    (``tenants_fenced``), each with its ``reason`` when it does; off a
    fleet, ``{"fenced": false}``."""
    if app.get(FLEET) is None and app.get(FOLLOWER) is None:
        return {"fenced": False}
    writes, tenants = fenced(app), tenants_fenced(app)
    out: dict[str, Any] = {"fenced": bool(writes), "tenants_fenced": bool(tenants)}
    if writes:
        out["reason"] = writes
    if tenants:
        out["tenants_reason"] = tenants
    return out
