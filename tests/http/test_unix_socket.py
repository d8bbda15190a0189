"""``listen = unix:PATH``: the same API on a unix socket for clients on the
same host, beside TCP, with one worker and several; the client library's
``unix:PATH`` endpoints; the socket file's mode, stale files and clean-up."""

from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kvstore_client import AsyncClient

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey
from kvstore.errors import ConfigError
from kvstore.server_config import load
from kvstore.transport.http.connection import KVAppRunner

from .conftest import ADMIN, ROOT, Daemon, server_config

pytestmark = pytest.mark.slow


async def _tenant(sock: str, name: str, policy: str) -> str:
    connector = aiohttp.UnixConnector(path=sock)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(
            "http://localhost/v1/admin/tenants",
            json={"name": name, "policy": policy},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as r,
    ):
        assert r.status == 201, await r.text()
        token: str = (await r.json())["token"]
    return token


@pytest.mark.parametrize("workers", [1, 2])
async def test_same_api_on_a_unix_socket_and_tcp(daemon: Daemon, tmp_path: Path, workers: int) -> None:
    sock = str(tmp_path / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--unix-socket-mode", "0600", "--workers", str(workers)]
    daemon.start()
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(sock).st_mode)
    rng = random.Random(workers)
    for policy in ("sealed", "direct"):
        token = await _tenant(sock, f"t-{policy}", policy)
        blocks = {f"k{i}": rng.randbytes(rng.randrange(1, 300_000)) for i in range(24)}
        async with AsyncClient(f"unix:{sock}", token) as local, AsyncClient(daemon.base, token) as tcp:
            for k, v in blocks.items():
                assert await local.put(k, v)
            for k, v in blocks.items():  # every worker: the kernel spreads connections over them
                assert await local.get(k) == v
                assert await tcp.get(k) == v
                a = len(v) // 3
                assert await local.get_range(k, a, a + 1000) == v[a : a + 1000]
            assert await local.lookup(list(blocks)) == len(blocks)
            assert await local.delete("k0")
            assert await tcp.get("k0") is None
            assert await local.get("missing") is None
    assert "unix:" + sock in daemon.log.read_text()
    assert daemon.stop() == 0
    assert not Path(sock).exists()  # removed at exit


def test_a_stale_socket_file_is_replaced_and_anything_else_refused(daemon: Daemon, tmp_path: Path) -> None:
    sock = str(tmp_path / "kv.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock)  # bound, never listening: what a daemon killed with SIGKILL leaves
    stale.close()
    daemon.extra = ["--listen", f"unix:{sock}"]
    daemon.start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(sock)
    # A second daemon on the same path is refused, and leaves the first's socket alone.
    other = subprocess.run(
        [sys.executable, str(ROOT / "server.py"), "--data-dir", str(tmp_path / "other"), "--listen", f"unix:{sock}"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.returncode != 0 and "another process is listening" in other.stderr
    assert Path(sock).exists()
    assert daemon.stop() == 0

    plain = tmp_path / "not-a-socket"
    plain.write_text("operator's file")
    refused = subprocess.run(
        [sys.executable, str(ROOT / "server.py"), "--data-dir", str(daemon.data_dir), "--listen", f"unix:{plain}"],
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "is not a socket" in refused.stderr
    assert plain.read_text() == "operator's file"


def test_listen_settings() -> None:
    cfg = load(None, env={}, flags={"listen": ["127.0.0.1:1", "unix:/run/kv.sock", "[::1]:2"]})
    assert cfg.tcp_addresses == [("127.0.0.1", 1), ("::1", 2)] and cfg.unix_paths == ["/run/kv.sock"]
    env = load(None, env={"KVSTORE_LISTEN": "unix:/a.sock, 127.0.0.1:3", "KVSTORE_UNIX_SOCKET_MODE": "0666"})
    assert env.listen == "unix:/a.sock,127.0.0.1:3" and env.unix_socket_mode == 0o666
    assert load(None, env={}).unix_socket_mode == 0o660
    bad = [
        {"listen": "unix:"},
        {"listen": "unix:/" + "x" * 120},
        {"listen": ["127.0.0.1:1", "127.0.0.1:1"]},
        {"listen": "localhost"},
        {"unix_socket_mode": "0999"},
        {"unix_socket_mode": "1777"},
    ]
    for flags in bad:
        name = next(iter(flags))
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}="):
            load(None, env={}, flags=flags)


def test_client_endpoints() -> None:
    with pytest.raises(ValueError, match="needs the socket's path"):
        AsyncClient("unix:", "t")
    assert AsyncClient(["unix:/run/kv.sock", "127.0.0.1:1"], "t").endpoints == [
        "unix:/run/kv.sock",
        "http://127.0.0.1:1",
    ]


async def test_the_workers_private_calls_are_not_on_the_public_socket(tmp_path: Path) -> None:
    """/_internal/ (calls between workers, without tokens) answers on the
    workers' private socket only: a client of a public unix socket gets the
    404 any unknown path gets. (A writer app, served on both sockets.)"""
    private, public = str(tmp_path / "writer.sock"), str(tmp_path / "kv.sock")
    cfg = server_config(tmp_path / "data", listen=f"unix:{public}")
    runner = KVAppRunner(make_app(cfg, MasterKey(os.urandom(32)), "writer", private))
    await runner.setup()
    try:
        await web.UnixSite(runner, private).start()
        await web.UnixSite(runner, public).start()
        for path, status in ((public, 404), (private, 204), (public, 404)):
            connector = aiohttp.UnixConnector(path=path)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.post("http://localhost/_internal/touches", json={}) as r,
            ):
                assert r.status == status, (path, await r.text())
    finally:
        await runner.cleanup()
