"""A block read on a reader worker a moment before the quota is enforced is
as recent as it is: the writer rings the readers' bells and takes their
accesses in before it picks victims (kvstore/touchbells.py). Without it, the
read reached the writer up to a second later (the relay's period), and the
quota's LRU took the block just read for the oldest."""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port
from tests.polling import until_now

BLOCK = 64 * 1024


def _conn(d: Daemon, role: str) -> http.client.HTTPConnection:
    """A keep-alive connection that reached the worker of ``role``."""
    for _ in range(200):
        c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        c.request("GET", "/healthz")
        r = c.getresponse()
        found = json.loads(r.read())["role"]
        if found == role:
            return c
        c.close()
    raise AssertionError(f"no connection reached the {role} in 200 tries")


def _call(c: http.client.HTTPConnection, method: str, path: str, token: str, body: bytes | None = None) -> int:
    c.request(method, path, body=body, headers={"Authorization": f"Bearer {token}"})
    r = c.getresponse()
    r.read()
    return r.status


def _keys(c: http.client.HTTPConnection, token: str) -> set[str]:
    c.request("GET", "/v1/keys?limit=1000", headers={"Authorization": f"Bearer {token}"})
    r = c.getresponse()
    return {k["key"] for k in json.loads(r.read())["keys"]}


def test_a_block_read_on_a_reader_just_before_the_quota_survives(tmp_path: Path) -> None:
    env = daemon_env(tmp_path, segment_size="4MiB", workers="2")
    d = Daemon(tmp_path / "data", free_port(), env)
    d.start()
    try:
        until_now("both workers listening", lambda: "with 2 workers" in d.log.read_text(), 60)
        writer, reader = _conn(d, "writer"), _conn(d, "reader")
        writer.request(
            "POST",
            "/v1/admin/tenants",
            body=json.dumps({"name": "q", "policy": "direct", "quota_bytes": 20 * (BLOCK + 4096)}).encode(),
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        r = writer.getresponse()
        token = json.loads(r.read())["token"]
        assert r.status == 201
        for i in range(20):
            assert _call(writer, "PUT", f"/v1/blocks/k{i:02d}", token, os.urandom(BLOCK)) == 201
        order = [f"k{i:02d}" for i in range(20)]  # the LRU order, oldest first, as the test made it
        evicted = 0
        for n in range(5):  # each round: the oldest block read on a reader, then a put over the quota
            oldest = order.pop(0)
            assert _call(reader, "GET", f"/v1/blocks/{oldest}", token) == 200
            order.append(oldest)
            assert _call(writer, "PUT", f"/v1/blocks/new{n}", token, os.urandom(BLOCK)) == 201
            order.append(f"new{n}")
            present = _keys(writer, token)  # a listing touches nothing
            assert oldest in present, f"round {n}: {oldest}, read on the reader just before the put, was evicted"
            gone = [k for k in order if k not in present]
            assert gone == order[: len(gone)], f"round {n}: evicted {gone}, not the least recently used"
            evicted += len(gone)
            order = order[len(gone) :]
        assert evicted >= 5, "the quota evicted too little: the test did not cross it each round"
        writer.close()
        reader.close()
    finally:
        assert d.stop() == 0
