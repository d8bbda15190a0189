"""``kvstore admin --wait`` on a real fleet of three daemons (moto's S3
server, two workers each): once the command returns, the change is in force
on every alive node, so the very next request on any node sees it, with no
retry and no wait of the test's own.

A fleet node answers a change of the tenant registry with the revision it
wrote (``Kvstore-Registry-Revision``); the command asks every alive member
(``GET /v1/fleet``) for the revision it holds (``GET /v1/admin/status``)
until each holds that one. The nodes run with ``s3_refresh_s = 30``: the
heartbeat's check of the registry (0.5 s here) is what brings a change.

Node 2 is advertised behind a proxy the test can cut: it stays alive in the
fleet (its heartbeats go to the bucket), but the command cannot ask it, so
``--wait`` must give up after ``--wait-timeout`` with exit status 4, naming
it, the change made all the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from kvstore_client.sharding import normalize, rank_endpoints

from ..http.admincli import admin, failed
from ..moto_s3 import S3Env
from .proxy import CuttableProxy
from .test_daemons import Fleet, call

ROUNDS = 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, s3: S3Env) -> Iterator[tuple[Fleet, CuttableProxy]]:
    f = Fleet(tmp_path_factory.mktemp("admin-wait"), s3, 3, s3_refresh_s="30")
    front = CuttableProxy(f.nodes[2].port)  # node 2 as the fleet (and the command) reach it
    f.nodes[2].env["KVSTORE_ADVERTISE_URL"] = front.url
    try:
        f.start()
        yield f, front
    finally:
        f.stop()
        front.close()


def _owned_key(fleet: Fleet, node: int, tag: str) -> str:
    """A key placement puts on ``node`` (so its PUT there is its owner's, whatever the fleet's routing)."""
    view = fleet.view(fleet.nodes[0])
    urls = sorted(normalize(m["url"]) for m in view["nodes"] if m["state"] == "alive")
    mine = normalize(next(m["url"] for m in view["nodes"] if m["id"] == f"node-{node}"))
    return next(k for i in range(10_000) if rank_endpoints(urls, k := f"{tag}-{i}")[0] == mine)


def _revisions(fleet: Fleet) -> list[int]:
    return [admin(d.base, "status", "--json").doc()["fleet"]["registry_revision"] for d in fleet.nodes]


def test_a_tenant_created_with_wait_is_in_force_on_every_node_at_once(fleet: tuple[Fleet, CuttableProxy]) -> None:
    f, _ = fleet
    n0, n1, n2 = f.nodes
    for r in range(ROUNDS):
        made = admin(n0.base, "tenants", "create", f"waited{r}", "--wait")
        assert made.code == 0, made.err
        token = made.out.strip()
        assert re.fullmatch(r"kvs_[A-Za-z0-9_-]+", token), made.out
        assert "in force on every alive node" in made.err, made.err
        for i, d in ((1, n1), (2, n2)):  # the first request after the command's return: no retry
            key = _owned_key(f, i, f"r{r}")
            put = call(d.base, "PUT", f"/v1/blocks/{key}", token, data=b"w" * 1000)
            assert put.status == 201, (d.base, put)
    revisions = _revisions(f)
    assert len(set(revisions)) == 1 and revisions[0] >= ROUNDS, revisions
    status = admin(n1.base, "status", "--json").doc()
    assert status["fleet"]["node_id"] == "node-1" and status["fence"] == {"fenced": False, "tenants_fenced": False}


def test_a_token_revoked_with_wait_is_refused_by_every_node_at_once(fleet: tuple[Fleet, CuttableProxy]) -> None:
    f, _ = fleet
    n0, n1, n2 = f.nodes
    assert admin(n1.base, "tenants", "create", "revoked", "--policy", "direct", "--wait").code == 0
    for _ in range(ROUNDS):
        issued = admin(n1.base, "tokens", "issue", "revoked", "--wait", "--json").doc()
        token = issued["token"]
        for d in (n0, n2):
            assert call(d.base, "GET", "/v1/stats", token).status == 200
        gone = admin(n0.base, "tokens", "revoke", "revoked", issued["token_id"], "--wait")
        assert gone.code == 0, gone.err
        for d in (n1, n2):  # the first request after the command's return
            refused = call(d.base, "GET", "/v1/stats", token)
            assert refused.status == 401, (d.base, refused)
    kept = admin(n2.base, "tokens", "issue", "revoked", "--wait").out.strip()
    assert admin(n2.base, "tenants", "delete", "revoked", "--wait").code == 0
    for d in (n0, n1):
        assert call(d.base, "GET", "/v1/stats", kept).status == 401


def test_wait_names_the_node_it_cannot_ask_and_exits_4(fleet: tuple[Fleet, CuttableProxy]) -> None:
    f, front = fleet
    n0, n1, _ = f.nodes
    assert admin(n0.base, "tenants", "create", "behind", "--wait").code == 0
    front.cut()
    try:
        ran = admin(n0.base, "tokens", "issue", "behind", "--wait", "--wait-timeout", "1")
        failed(ran, 4, "not on every alive node within 1 s", "node-2", front.url)
        assert "node-0" not in ran.err and "node-1" not in ran.err
        token = ran.out.strip()  # the change was made, and its token shown, all the same
        assert call(n1.base, "GET", "/v1/stats", token).status == 200
    finally:
        front.heal()
    again = admin(n0.base, "tokens", "issue", "behind", "--wait")
    assert again.code == 0 and "in force on every alive node" in again.err, again.err
    # --json: the answer alone on stdout, even when it waits
    doc = admin(n0.base, "tokens", "issue", "behind", "--wait", "--json").doc()
    assert doc["name"] == "behind"
