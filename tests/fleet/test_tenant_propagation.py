"""Tenant changes reach every node of a fleet within one heartbeat (issue 40,
"changes at once"), on three daemons and moto's S3 server.

Each heartbeat a node checks the fleet's registry object's etag and takes
the document when it changed (kvstore/fleet/registry.py, ``check``), so a
change is in force on every alive node within one heartbeat, plus the
check's time, of its admin call's answer. The nodes here run with
``s3_refresh_s = 30``: the 30 s backstop cannot be what makes a change
arrive in time. A node that cannot confirm its registry (cut from the
bucket) refuses tenant operations ``fleet_dead_after_s - fleet_heartbeat_s``
into its silence (503 ``fenced``), and serves them again once it can.

The measured times (from the admin call's answer to the first request that
saw the change, per node) are printed (run with ``-s``) and written to
``propagation.json`` in the test's temporary directory.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..http.conftest import Daemon
from ..moto_s3 import S3Env
from .test_daemons import DEAD_AFTER_S, HEARTBEAT_S, Fleet, call, until

FENCE_AFTER_S = DEAD_AFTER_S - HEARTBEAT_S
SLACK_S = 1.5  # the check's own time (a HEAD, a GET, the registry installed), the polling, a loaded machine
BOUND_S = HEARTBEAT_S + SLACK_S  # far below the backstop's 30 s
ROUNDS = 5


@pytest.fixture
def fleet(tmp_path: Path, s3: S3Env) -> Iterator[Fleet]:
    f = Fleet(tmp_path, s3, 3, s3_refresh_s="30")
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _first_times(checks: dict[str, Callable[[], bool]], since: float, timeout: float) -> dict[str, float]:
    """Seconds from ``since`` until each check first holds (each polled in
    turn, as fast as the daemons answer); fails after ``timeout``."""
    took: dict[str, float] = {}
    while len(took) < len(checks):
        for name, check in checks.items():
            if name not in took and check():
                took[name] = time.monotonic() - since
        assert time.monotonic() - since < timeout, f"not within {timeout} s: {sorted(set(checks) - set(took))}"
    return took


def _refuses(base: str, token: str) -> bool:
    return call(base, "GET", "/v1/stats", token).status == 401


def _status(base: str, token: str, key: str) -> int:
    return call(base, "GET", f"/v1/blocks/{key}", token).status


def _refused_by(nodes: tuple[Daemon, ...], token: str) -> dict[str, Callable[[], bool]]:
    return {d.base: functools.partial(_refuses, d.base, token) for d in nodes}


def _record(tmp_path: Path, what: str, samples: list[float]) -> None:
    line = (
        f"{what}: {len(samples)} samples, median {statistics.median(samples) * 1000:.0f} ms, "
        f"max {max(samples) * 1000:.0f} ms (heartbeat {HEARTBEAT_S * 1000:.0f} ms)"
    )
    print(line)
    path = tmp_path / "propagation.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[what] = {"samples_s": [round(s, 4) for s in samples], "median_s": statistics.median(samples)}
    path.write_text(json.dumps(doc, indent=1))


def _registry_versions(fleet: Fleet) -> list[float]:
    out = []
    for d in fleet.nodes:
        text = call(d.base, "GET", "/metrics").body
        text = text.decode() if isinstance(text, bytes) else str(text)
        line = next(x for x in text.splitlines() if x.startswith("kvstore_fleet_registry_version"))
        out.append(float(line.split()[-1]))
    return out


def test_a_tenant_created_on_one_node_reads_and_writes_through_the_others_within_a_heartbeat(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Created on node 0; from the admin call's answer, a PUT through node 1
    and one through node 2 are each retried until they land (201), then read
    back through the node that took them. Each must land within one
    heartbeat and the slack, five times over."""
    n0, n1, n2 = fleet.nodes
    samples: list[float] = []
    for r in range(ROUNDS):
        made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": f"new{r}", "policy": "sealed"})
        answered = time.monotonic()
        assert made.status == 201, made
        token = made.body["token"]

        def put(d: Daemon, token: str = token) -> bool:  # each node's own key (a node stores only those)
            return (
                call(d.base, "PUT", f"/v1/blocks/{fleet.key_on(d, 'first')}", token, data=d.base.encode() * 100).status
                == 201
            )

        took = _first_times({"node-1": lambda: put(n1), "node-2": lambda: put(n2)}, answered, 30)
        for d in (n1, n2):
            got = call(d.base, "GET", f"/v1/blocks/{fleet.key_on(d, 'first')}", token)
            assert got.status == 200 and got.body == d.base.encode() * 100
        samples += took.values()
    _record(tmp_path, "created on node-0, in force on nodes 1 and 2", samples)
    assert max(samples) <= BOUND_S, samples
    # Every node holds the same revision of the fleet's registry, one per change at least (with
    # several workers /metrics merges snapshots the workers write every 0.5 s: polled).
    until(
        "one registry version on every node",
        lambda: len(set(v := _registry_versions(fleet))) == 1 and v[0] >= 1 + ROUNDS,
        5,
    )


def test_a_token_revoked_on_one_node_is_refused_by_the_others_within_a_heartbeat(fleet: Fleet, tmp_path: Path) -> None:
    """A token revoked on node 1 answers 401 on nodes 0 and 2 within one
    heartbeat and the slack of the revocation's answer; a tenant deleted on
    node 1, the same for its other token."""
    n0, n1, n2 = fleet.nodes
    made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "rev", "policy": "direct"})
    assert made.status == 201, made
    kept = made.body["token"]
    revoked: list[float] = []
    for _ in range(ROUNDS):
        issued = call(n1.base, "POST", "/v1/admin/tenants/rev/tokens")
        assert issued.status == 201, issued
        token = issued.body["token"]
        fleet.wait_token(token)
        gone = call(n1.base, "DELETE", f"/v1/admin/tenants/rev/tokens/{issued.body['token_id']}")
        answered = time.monotonic()
        assert gone.status == 204, gone
        took = _first_times(_refused_by((n0, n2), token), answered, 30)
        revoked += took.values()
        assert call(n1.base, "GET", "/v1/stats", token).status == 401  # (the answering node: before its answer)
    _record(tmp_path, "token revoked on node-1, refused by nodes 0 and 2", revoked)
    assert max(revoked) <= BOUND_S, revoked
    assert all(call(d.base, "GET", "/v1/stats", kept).status == 200 for d in fleet.nodes)
    deleted = call(n1.base, "DELETE", "/v1/admin/tenants/rev")
    answered = time.monotonic()
    assert deleted.status == 204, deleted
    took = _first_times(_refused_by((n0, n2), kept), answered, 30)
    _record(tmp_path, "tenant deleted on node-1, refused by nodes 0 and 2", list(took.values()))
    assert max(took.values()) <= BOUND_S, took


def test_a_node_cut_from_the_bucket_refuses_tenant_operations_until_it_reconnects(fleet: Fleet, tmp_path: Path) -> None:
    """Node 2 cut from the bucket serves its tenant until it has gone
    ``fleet_dead_after_s - fleet_heartbeat_s`` without confirming the
    fleet's registry, then refuses its token (reads too) with 503
    ``fenced``, naming the registry; healed, it serves again."""
    n0, _, n2 = fleet.nodes
    made = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "cut", "policy": "direct"})
    token = made.body["token"]
    fleet.wait_token(token)
    before = fleet.key_on(n2, "before")  # node-2's own key (a node stores only those)
    assert call(n2.base, "PUT", f"/v1/blocks/{before}", token, data=b"b" * 1000).status == 201
    fleet.proxies[2].cut()
    cut = time.monotonic()
    assert call(n2.base, "GET", f"/v1/blocks/{before}", token).status == 200  # (its registry is still confirmed)
    took = _first_times(
        {"fenced": lambda: call(n2.base, "GET", f"/v1/blocks/{before}", token).status == 503}, cut, FENCE_AFTER_S + 5
    )["fenced"]
    # Every worker of it (a reader from its writer's published state, a moment later).
    until("node-2 refuses on every worker", lambda: all(_status(n2.base, token, before) == 503 for _ in range(10)), 3)
    r = call(n2.base, "GET", f"/v1/blocks/{before}", token)
    assert r.status == 503 and r.body["error"]["code"] == "fenced", r
    assert "refuses tenant operations" in r.body["error"]["message"], r
    assert "tenant registry" in r.body["error"]["message"], r
    assert call(n2.base, "GET", "/v1/stats", "kvs_not_a_token").status == 503  # nor says a token is unknown
    assert call(n0.base, "GET", "/v1/stats", token).status == 200  # the others serve on
    # (said in its log at its next check: a heartbeat after the first refusal at most)
    until("node-2 logs the fence", lambda: "refusing tenant operations" in n2.log.read_text(), HEARTBEAT_S + 3)
    fleet.proxies[2].heal()
    healed = time.monotonic()
    back = _first_times(
        {"served": lambda: call(n2.base, "GET", f"/v1/blocks/{before}", token).status == 200},
        healed,
        4 * DEAD_AFTER_S,
    )["served"]
    until("node-2 serves on every worker", lambda: all(_status(n2.base, token, before) == 200 for _ in range(10)), 3)
    _record(tmp_path, "cut from the bucket: tenant operations refused after", [took])
    _record(tmp_path, "healed: tenant operations served again after", [back])
    assert took <= FENCE_AFTER_S + SLACK_S + HEARTBEAT_S, took
    assert "serving tenants again" in n2.log.read_text()
