"""Regression tests of issue 16 (hostile input), each named after its defect."""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.crypto import MasterKey
from kvstore.transport.http import make_app
from tests.http.conftest import ADMIN, Daemon, server_config
from tests.http.rawhttp import Conn, Reply, worker_connections

# Path parameters that decode to path syntax: percent-encoded '?', '#', '/',
# and '..' segments. Before the fix a reader relayed the decoded path, so the
# writer saw '/v1/blocks/a?junk' (key 'a') or '/v1/admin/tenants/victim3'.
HOSTILE_PARAMS = [
    "a%3Fjunk",
    "b%23junk",
    "zz%2F..%2Fx",
    "..%2F..%2Fv1%2Fadmin%2Ftenants%2Fvictim3",
    "..%2F..%2Fv1%2Fadmin%2Ftenants",
    "%2E%2E%2F",
    "a%00b",
    "%C3%A9",
    "a%252Fb",
]
RAW_PATHS = [
    ("POST", "/v1/admin/tenants%2F..%2Ftenants"),
    ("POST", "/v1/admin/tenants/..%2Ftenants"),
    ("DELETE", "/v1/admin/tenants/t1%2F..%2Fvictim3"),
    ("GET", "/v1/blocks/a/../b"),
    ("DELETE", "/v1/blocks/a/../b"),
    ("DELETE", "/v1//blocks/a"),
    ("DELETE", "/v1/blocks/"),
    ("PUT", "/v1/blocks/"),
    ("DELETE", "/v1/admin/tenants/"),
    ("PATCH", "/v1/blocks/a"),
    ("GET", "/v1/nothing"),
]


def _routes(tmp: Path) -> list[tuple[str, str]]:
    """Every (method, pattern) the daemon registers."""
    app = make_app(server_config(tmp / "routes"), MasterKey(os.urandom(32)))
    return sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None})


def _fill(pattern: str, value: str) -> str:
    for name in ("{key}", "{name}", "{token_id}"):
        pattern = pattern.replace(name, value)
    return pattern


async def _setup(conn: Conn) -> dict[str, str]:
    tokens = {}
    for name in ("t1", "victim3"):
        r = await conn.request(
            "POST", "/v1/admin/tenants", {"Authorization": f"Bearer {ADMIN}"}, b'{"name": "%s"}' % name.encode()
        )
        assert r.status == 201, r.body
        tokens[name] = r.json()["token"]
    for key in ("a", "b", "x", "b%23junk"):
        h = {"Authorization": f"Bearer {tokens['t1']}"}
        r = await conn.request("PUT", f"/v1/blocks/{key}", h, key.encode() * 10)
        assert r.status in (201, 400), r.body
    return tokens


def _differ(a: Reply, b: Reply) -> str | None:
    if (a.status, a.code) == (b.status, b.code):
        return None
    return f"{a.status} {a.code} vs {b.status} {b.code}"


async def test_reader_relayed_decoded_path_to_writer(daemon: Daemon, tmp_path: Path) -> None:
    """Every route, given path parameters that decode to path syntax, answers
    the same on the writer and on a reader, and nothing is deleted or created."""
    daemon.extra = ["--workers", "2"]
    daemon.start()
    conns = await worker_connections("127.0.0.1", daemon.port)
    try:
        tokens = await _setup(conns["writer"])
        auths = {
            "admin": {"Authorization": f"Bearer {ADMIN}"},
            "tenant": {"Authorization": f"Bearer {tokens['t1']}"},
            "none": {},
        }
        requests = [(m, _fill(p, v)) for m, p in _routes(tmp_path) if "{" in p for v in HOSTILE_PARAMS]
        requests += RAW_PATHS
        requests += [(m, p) for m, p in _routes(tmp_path) if "{" not in p and m != "HEAD" and p.startswith("/v1/")]
        mismatches = []
        for method, path in requests:
            for who, h in auths.items():
                if method == "POST" and path == "/v1/admin/tenants" and who == "admin":
                    continue  # would create a tenant on the first worker: a 409 on the second
                if method == "POST" and path == "/v1/admin/flush":
                    continue  # valid on both, and slow
                body = b"{}" if method in ("PUT", "POST") else b""
                answers = {role: await c.request(method, path, h, body) for role, c in conns.items()}
                diff = _differ(answers["writer"], answers["reader"])
                if diff is not None:
                    mismatches.append((who, method, path, diff))
                for role, r in answers.items():
                    assert r.status < 500, (role, who, method, path, r.status, r.body)
        assert not mismatches, mismatches
        # Nothing the hostile requests named was touched, through either worker.
        for role, c in conns.items():
            h = {"Authorization": f"Bearer {tokens['t1']}"}
            for key in ("a", "b", "x"):
                r = await c.request("GET", f"/v1/blocks/{key}", h)
                assert r.status == 200 and r.body == key.encode() * 10, (role, key, r.status)
            r = await c.request("GET", "/v1/admin/tenants", auths["admin"])
            assert sorted(t["name"] for t in r.json()["tenants"]) == ["t1", "victim3"], (role, r.body)
            r = await c.request("GET", "/v1/stats", {"Authorization": f"Bearer {tokens['victim3']}"})
            assert r.status == 200, (role, r.status)
    finally:
        for c in conns.values():
            await c.close()
