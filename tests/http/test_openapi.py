"""docs/openapi.yaml is true: a valid OpenAPI 3.1 document, every route the
daemon registers is described and every described operation is a route, and
real answers to every operation match what it describes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvstore_client.wire import batchframe
from openapi_spec_validator import validate

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey
from kvstore.transport.http.internal import PREFIX as INTERNAL_PREFIX
from tests.http.conftest import ADMIN, Api, server_config
from tests.http.openapi import Spec


def test_spec_is_valid_openapi_3_1() -> None:
    spec = Spec.load()
    assert spec.doc["openapi"].startswith("3.1.")
    validate(spec.doc)


def test_every_route_is_described_and_every_description_is_a_route(tmp_path: Path) -> None:
    for role in ("single", "writer"):
        app = make_app(server_config(tmp_path / role), MasterKey(os.urandom(32)), role)
        routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
        # Calls between workers (the writer's unix socket only) are not the API.
        routes = {(m, p) for m, p in routes if not p.startswith(INTERNAL_PREFIX)}
        described = {(op.method, op.path) for op in Spec.load().operations()}
        assert not routes - described, f"routes missing from docs/openapi.yaml: {sorted(routes - described)}"
        assert not described - routes, f"described in docs/openapi.yaml, not routes: {sorted(described - routes)}"


async def test_answers_match_the_description(api: Api) -> None:
    """Every operation, called for real (successes and the usual errors); each
    answer's status, content type and JSON body must be described."""
    spec = Spec.load()
    token = await api.tenant("alice")
    t, admin = api.auth(token), api.auth(ADMIN)
    # A tenant that stores a block at its second offer (admit_after): 202s. Connection:
    # close takes the PUT off the fast lane, to the route (its body: test_admission.py).
    carol = {**api.auth(await api.tenant("carol", admit_after=2)), "Connection": "close"}
    batch = batchframe.encode_put_stream([("b1", b"1" * 100), ("b2", b"2" * 50)])
    calls: list[tuple[str, str, str, dict[str, str], bytes, int]] = [
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/k1", t, b"x" * 1000, 201),
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/k1", t, b"y" * 10, 200),
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/k%2F1", t, b"x", 400),
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/k1", {}, b"x", 401),
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/k2", t, b"", 400),
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/c1", carol, b"c" * 100, 202),
        ("POST", "/v1/batch/put", "/v1/batch/put", carol, batch, 200),
        ("GET", "/v1/blocks/{key}", "/v1/blocks/k1", t, b"", 200),
        ("GET", "/v1/blocks/{key}", "/v1/blocks/k1", {**t, "Range": "bytes=0-9"}, b"", 206),
        ("GET", "/v1/blocks/{key}", "/v1/blocks/k1", {**t, "Range": "bytes=5000-"}, b"", 416),
        ("GET", "/v1/blocks/{key}", "/v1/blocks/nope", t, b"", 404),
        ("HEAD", "/v1/blocks/{key}", "/v1/blocks/k1", t, b"", 200),
        ("HEAD", "/v1/blocks/{key}", "/v1/blocks/nope", t, b"", 404),
        ("POST", "/v1/lookup", "/v1/lookup", t, b'{"keys": ["k1", "nope"]}', 200),
        ("POST", "/v1/lookup", "/v1/lookup", t, b'{"keys": [', 400),
        ("POST", "/v1/lookup", "/v1/lookup", {**t, "Content-Type": "application/json; charset=koi8-r"}, b"{}", 415),
        ("GET", "/v1/stats", "/v1/stats", t, b"", 200),
        ("GET", "/v1/records/{key}", "/v1/records/k1", t, b"", 200),
        ("GET", "/v1/records/{key}", "/v1/records/k1", {**t, "Range": "bytes=10-99"}, b"", 200),
        ("GET", "/v1/records/{key}", "/v1/records/k1", {**t, "Range": "bytes=5000-"}, b"", 416),
        ("GET", "/v1/records/{key}", "/v1/records/nope", t, b"", 404),
        ("GET", "/v1/records/{key}", "/v1/records/k1", {}, b"", 401),
        # Read plans with descriptors are for the unix socket (tests/http/test_read_plans.py checks them).
        ("POST", "/v1/read-plan", "/v1/read-plan", t, b'{"keys": ["k1"]}', 400),
        # Plans with paths need plan_paths (tests/http/test_plan_paths.py checks them with it on).
        ("POST", "/v1/read-plan", "/v1/read-plan", t, b'{"keys": ["k1"], "paths": true}', 400),
        ("POST", "/v1/read-plan", "/v1/read-plan", {}, b'{"keys": ["k1"]}', 401),
        ("DELETE", "/v1/read-plan/{lease}", "/v1/read-plan/" + "0" * 32, t, b"", 400),
        ("DELETE", "/v1/read-plan/{lease}", "/v1/read-plan/nope", t, b"", 400),
        ("POST", "/v1/write-plan", "/v1/write-plan", t, b'{"blocks": [{"key": "k1", "size": 1}]}', 400),
        ("POST", "/v1/write-plan", "/v1/write-plan", {}, b'{"blocks": [{"key": "k1", "size": 1}]}', 401),
        (
            "POST",
            "/v1/write-plan/{plan}",
            "/v1/write-plan/" + "0" * 32,
            t,
            b'{"blocks": [{"key": "k1", "xxh3": ["0000000000000000"]}]}',
            404,
        ),
        ("POST", "/v1/write-plan/{plan}", "/v1/write-plan/nope", t, b'{"blocks": []}', 400),
        ("DELETE", "/v1/write-plan/{plan}", "/v1/write-plan/" + "0" * 32, t, b"", 404),
        ("PUT", "/v1/write-plan/{plan}/blocks/{key}", "/v1/write-plan/" + "0" * 32 + "/blocks/k1", t, b"x", 404),
        # Key listing (tests/http/test_key_listing.py checks it).
        ("GET", "/v1/keys", "/v1/keys?prefix=k&limit=5", t, b"", 200),
        ("GET", "/v1/keys", "/v1/keys?limit=0", t, b"", 400),
        ("GET", "/v1/keys", "/v1/keys", {}, b"", 401),
        # Locks (tests/http/test_lock_leases.py checks them): a lookup with lease_s, a release.
        ("POST", "/v1/lookup", "/v1/lookup", t, b'{"keys": ["k1", "nope"], "lease_s": 5}', 200),
        ("POST", "/v1/lookup", "/v1/lookup", t, b'{"keys": ["nope"], "lease_s": 5}', 200),
        ("POST", "/v1/lookup", "/v1/lookup", t, b'{"keys": ["k1"], "lease_s": 0}', 400),
        ("DELETE", "/v1/leases/{lease}", "/v1/leases/" + "0" * 32, t, b"", 404),
        ("DELETE", "/v1/leases/{lease}", "/v1/leases/" + "0" * 32, {}, b"", 401),
        # NIXL transfers need nixl = true (tests/http/test_nixl.py checks them with real agents).
        ("POST", "/v1/xfer/agents", "/v1/xfer/agents", t, b'{"name": "a", "metadata": ""}', 404),
        ("POST", "/v1/xfer/read", "/v1/xfer/read", t, b'{"agent": "a", "keys": ["k1"]}', 404),
        ("POST", "/v1/xfer/read", "/v1/xfer/read", {}, b'{"agent": "a", "keys": ["k1"]}', 401),
        ("POST", "/v1/xfer/release", "/v1/xfer/release", t, b'{"lease": "x"}', 404),
        ("POST", "/v1/xfer/write", "/v1/xfer/write", t, b'{"agent": "a", "blocks": []}', 404),
        # The event stream does not end (tests/http/test_events.py reads it); its refusals here.
        ("GET", "/v1/events", "/v1/events?since=x", t, b"", 400),
        ("GET", "/v1/events", "/v1/events", {}, b"", 401),
        ("HEAD", "/v1/stats", "/v1/stats", t, b"", 200),
        # Not in a fleet here (tests/fleet/test_daemons.py runs one).
        ("GET", "/v1/fleet", "/v1/fleet", t, b"", 404),
        ("GET", "/v1/fleet", "/v1/fleet", {}, b"", 401),
        ("HEAD", "/v1/fleet", "/v1/fleet", admin, b"", 404),
        ("DELETE", "/v1/admin/fleet/nodes/{node_id}", "/v1/admin/fleet/nodes/node-9", admin, b"", 404),
        ("DELETE", "/v1/admin/fleet/nodes/{node_id}", "/v1/admin/fleet/nodes/Bad_Id", admin, b"", 400),
        ("DELETE", "/v1/admin/fleet/nodes/{node_id}", "/v1/admin/fleet/nodes/node-9", t, b"", 401),
        ("POST", "/v1/batch/put", "/v1/batch/put", t, batch, 200),
        ("POST", "/v1/batch/put", "/v1/batch/put", t, b"NOPE", 400),
        ("POST", "/v1/batch/get", "/v1/batch/get", t, b'{"keys": ["b1", "zz"]}', 200),
        ("POST", "/v1/batch/get", "/v1/batch/get", t, b'{"keys": 1}', 400),
        ("DELETE", "/v1/blocks/{key}", "/v1/blocks/b2", t, b"", 204),
        ("DELETE", "/v1/blocks/{key}", "/v1/blocks/b2", t, b"", 404),
        ("POST", "/v1/admin/tenants", "/v1/admin/tenants", admin, b'{"name": "bob", "policy": "direct"}', 201),
        ("POST", "/v1/admin/tenants", "/v1/admin/tenants", admin, b'{"name": "bob"}', 409),
        ("POST", "/v1/admin/tenants", "/v1/admin/tenants", t, b'{"name": "eve"}', 401),
        ("GET", "/v1/admin/tenants", "/v1/admin/tenants", admin, b"", 200),
        ("HEAD", "/v1/admin/tenants", "/v1/admin/tenants", admin, b"", 200),
        ("GET", "/v1/admin/tenants/{name}", "/v1/admin/tenants/alice", admin, b"", 200),
        ("GET", "/v1/admin/tenants/{name}", "/v1/admin/tenants/nobody", admin, b"", 404),
        ("HEAD", "/v1/admin/tenants/{name}", "/v1/admin/tenants/alice", admin, b"", 200),
        ("POST", "/v1/admin/tenants/{name}/tokens", "/v1/admin/tenants/bob/tokens", admin, b"", 201),
        ("POST", "/v1/admin/tenants/{name}/s3-keys", "/v1/admin/tenants/bob/s3-keys", admin, b"", 201),
        ("POST", "/v1/admin/tenants/{name}/s3-keys", "/v1/admin/tenants/nobody/s3-keys", admin, b"", 404),
        ("GET", "/v1/admin/tenants/{name}/s3-keys", "/v1/admin/tenants/bob/s3-keys", admin, b"", 200),
        ("GET", "/v1/admin/tenants/{name}/s3-keys", "/v1/admin/tenants/bob/s3-keys", t, b"", 401),
        ("POST", "/v1/admin/tenants/{name}/rotate-key", "/v1/admin/tenants/alice/rotate-key", admin, b"", 200),
        ("POST", "/v1/admin/master-key", "/v1/admin/master-key", admin, b'{"key_file": "/nonexistent"}', 400),
        ("GET", "/v1/admin/status", "/v1/admin/status", admin, b"", 200),
        ("GET", "/v1/admin/status", "/v1/admin/status", t, b"", 401),
        ("POST", "/v1/admin/flush", "/v1/admin/flush", admin, b"", 200),
        ("POST", "/v1/admin/flush", "/v1/admin/flush?timeout_s=-1", admin, b"", 400),
        ("POST", "/v1/admin/verify", "/v1/admin/verify?deep=true", admin, b"", 200),
        ("PATCH", "/v1/admin/tenants/{name}", "/v1/admin/tenants/alice", admin, b'{"quota_bytes": 65536}', 200),
        ("PATCH", "/v1/admin/tenants/{name}", "/v1/admin/tenants/alice", admin, b'{"ttl_s": null}', 200),
        ("PATCH", "/v1/admin/tenants/{name}", "/v1/admin/tenants/carol", admin, b'{"admit_window_s": 60}', 200),
        ("PATCH", "/v1/admin/tenants/{name}", "/v1/admin/tenants/carol", admin, b'{"admit_after": 0}', 400),
        ("PATCH", "/v1/admin/tenants/{name}", "/v1/admin/tenants/alice", admin, b"{}", 400),
        ("PATCH", "/v1/admin/tenants/{name}", "/v1/admin/tenants/nobody", admin, b'{"ttl_s": 60}', 404),
        ("PUT", "/v1/blocks/{key}", "/v1/blocks/over-quota", t, b"q" * 70_000, 507),
        ("POST", "/v1/admin/compact", "/v1/admin/compact", admin, b"", 200),
        ("POST", "/v1/admin/compact", "/v1/admin/compact?tenant=alice", admin, b"", 200),
        ("POST", "/v1/admin/compact", "/v1/admin/compact?tenant=nobody", admin, b"", 404),
        ("GET", "/healthz", "/healthz", {}, b"", 200),
        ("HEAD", "/healthz", "/healthz", {}, b"", 200),
        ("GET", "/readyz", "/readyz", {}, b"", 200),
        ("GET", "/readyz", "/readyz", admin, b"", 200),
        ("HEAD", "/readyz", "/readyz", {}, b"", 200),
        ("GET", "/metrics", "/metrics", {}, b"", 200),
        ("HEAD", "/metrics", "/metrics", {}, b"", 200),
    ]
    problems: list[str] = []
    exercised = set()
    for method, pattern, path, headers, body, status in calls:
        async with api.session.request(method, api.url(path), headers=headers, data=body or None) as r:
            data = await r.read()
            assert r.status == status, (method, path, r.status, data[:200])
            problems += spec.problems(method, pattern, r.status, r.headers.get("Content-Type", ""), data)
        exercised.add((method, pattern))
    async with api.session.get(api.url("/v1/admin/tenants/bob"), headers=admin) as r:
        bob = json.loads(await r.read())
        token_id = bob["tokens"][0]["id"]  # revoked, then bob deleted
        access_key_id = bob["s3_keys"][0]["access_key_id"]
    for method, pattern, path, status in (
        (
            "DELETE",
            "/v1/admin/tenants/{name}/s3-keys/{access_key_id}",
            f"/v1/admin/tenants/bob/s3-keys/{access_key_id}",
            204,
        ),
        (
            "DELETE",
            "/v1/admin/tenants/{name}/s3-keys/{access_key_id}",
            f"/v1/admin/tenants/bob/s3-keys/{access_key_id}",
            404,
        ),
        ("DELETE", "/v1/admin/tenants/{name}/s3-keys/{access_key_id}", "/v1/admin/tenants/bob/s3-keys/lower-case", 400),
        ("DELETE", "/v1/admin/tenants/{name}/tokens/{token_id}", f"/v1/admin/tenants/bob/tokens/{token_id}", 204),
        ("DELETE", "/v1/admin/tenants/{name}/tokens/{token_id}", "/v1/admin/tenants/bob/tokens/0000000000000000", 404),
        ("DELETE", "/v1/admin/tenants/{name}", "/v1/admin/tenants/bob", 204),
        ("DELETE", "/v1/admin/tenants/{name}", "/v1/admin/tenants/bob", 404),
    ):
        async with api.session.request(method, api.url(path), headers=admin) as r:
            data = await r.read()
            assert r.status == status, (method, path, r.status, data[:200])
            problems += spec.problems(method, pattern, r.status, r.headers.get("Content-Type", ""), data)
        exercised.add((method, pattern))
    assert not problems, problems
    assert exercised == {(op.method, op.path) for op in spec.operations()}
