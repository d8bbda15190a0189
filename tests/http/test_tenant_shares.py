"""No tenant takes another's share of a worker (issue 28's stalled-body
attack): one tenant's PUTs that declare large bodies and send a few bytes
held the worker's whole ``max_buffered_body_bytes``, so every other tenant's
PUT got ``503 overloaded`` until ``request_timeout_s``; enough of them held
every slot of ``max_concurrency`` and other tenants' GETs failed too. Each
tenant now holds at most its share of both (half, or one block's body at
least), on every worker and on the fast lane."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port
from tests.http.rawhttp import Conn, worker_connections

BIG = 64 << 20
SETTINGS = {
    "max_block_size": "64MiB",
    "max_buffered_body_bytes": "256MiB",  # four stalled 64 MiB bodies would have held all of it
    "max_concurrency": "64",
}


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _stall(port: int, token: str, key: str, declared: int) -> Conn:
    """A PUT that declares ``declared`` bytes, sends 1 KiB of them (or fewer) and stops."""
    conn = await Conn.open("127.0.0.1", port)
    head = f"PUT /v1/blocks/{key} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
    await conn.send(f"{head}Content-Length: {declared}\r\n\r\n".encode() + b"x" * min(1024, declared - 1))
    return conn


@pytest.mark.parametrize("workers", [1, 2])
async def test_stalled_bodies_of_one_tenant_leave_other_tenants_puts_and_gets_alone(
    tmp_path: Path, workers: int
) -> None:
    env = {**daemon_env(tmp_path), **{"KVSTORE_" + k.upper(): v for k, v in SETTINGS.items()}}
    daemon = Daemon(tmp_path / "data", free_port(), env, extra=["--workers", str(workers)], log_dir=tmp_path)
    daemon.start()
    stalled: list[Conn] = []
    try:
        conn = await Conn.open("127.0.0.1", daemon.port)
        tokens = {}
        try:
            for _ in range(100):
                if (await conn.request("GET", "/readyz")).status == 200:
                    break
                await asyncio.sleep(0.1)
            for name in ("attacker", "victim"):
                body = json.dumps({"name": name, "policy": "direct"}).encode()
                r = await conn.request("POST", "/v1/admin/tenants", _auth(ADMIN), body)
                assert r.status == 201, r.body
                tokens[name] = r.json()["token"]
            warm = os.urandom(1 << 20)
            r = await conn.request("PUT", "/v1/blocks/warm", _auth(tokens["victim"]), warm)
            assert r.status == 201, r.body
        finally:
            await conn.close()
        # 20 bodies of 64 MiB (1.25 GiB declared, five times the budget), then
        # 80 small stalled bodies (more than max_concurrency), spread over the workers.
        for i in range(20):
            stalled.append(await _stall(daemon.port, tokens["attacker"], f"big{i}", BIG))
        for i in range(80):
            stalled.append(await _stall(daemon.port, tokens["attacker"], f"small{i}", 4096))
        await asyncio.sleep(1.0)
        conns = await worker_connections("127.0.0.1", daemon.port) if workers > 1 else None
        targets = conns or {"writer": await Conn.open("127.0.0.1", daemon.port)}
        try:
            for role, c in targets.items():
                for i in range(3):
                    data = os.urandom(2 << 20)
                    r = await c.request("PUT", f"/v1/blocks/{role}{i}", _auth(tokens["victim"]), data)
                    assert r.status == 201, (role, i, r.status, r.body[:300])
                    r = await c.request("GET", f"/v1/blocks/{role}{i}", _auth(tokens["victim"]))
                    assert r.status == 200 and r.body == data, (role, i, r.status)
                r = await c.request("GET", "/v1/blocks/warm", _auth(tokens["victim"]))
                assert r.status == 200 and r.body == warm, role
                lookup = json.dumps({"keys": ["warm", "nope"]}).encode()
                r = await c.request("POST", "/v1/lookup", _auth(tokens["victim"]), lookup)
                assert r.status == 200 and r.json()["present"] == [True, False], role
        finally:
            for c in targets.values():
                await c.close()
        # The attacker's own requests past its share were refused at once, saying why.
        refused = []
        for c in stalled:
            try:
                r = await c.read_reply(timeout=0.05)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                continue
            refused.append((r.status, r.json()["error"]["code"], r.json()["error"]["message"]))
        assert refused and {s for s, _, _ in refused} == {503}, refused[:3]
        assert any("share" in m for _, _, m in refused), refused[:3]
    finally:
        for c in stalled:
            await c.close()
        assert daemon.stop() == 0
