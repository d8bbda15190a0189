"""One daemon per address: a second daemon never joins a busy listener.

Used to be: with 2+ workers the listener set SO_REUSEPORT, so a second
daemon (another data directory) started on the same port said "serving",
and from then on the kernel split connections between the two stores: of
six tenants created through the port, one landed in one store and five in
the other. Now the supervisor binds each address once, without SO_REUSEPORT,
and its workers inherit the socket.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port


def _tenants(base: str) -> list[str]:
    req = urllib.request.Request(base + "/v1/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return sorted(t["name"] for t in json.loads(r.read())["tenants"])


def _create(base: str, name: str) -> None:
    body = json.dumps({"name": name}).encode()
    req = urllib.request.Request(
        base + "/v1/admin/tenants", data=body, headers={"Authorization": f"Bearer {ADMIN}"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 201


def _refused(d: Daemon) -> str:
    """Start ``d`` and wait for it to stop by itself (its port answers at once:
    the other daemon's); what it printed."""
    with pytest.raises(RuntimeError) as e:  # it may be seen exiting while start() waits
        d.start()
        assert d.proc is not None
        rc = d.proc.wait(60)
        d.proc = None
        raise RuntimeError(f"server exited with {rc}: {d.log.read_text()}")
    return str(e.value)


def _pair(tmp_path: Path, workers: str, sock: Path) -> tuple[Daemon, Daemon]:
    port = free_port()
    made = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        env = daemon_env(tmp_path / name, segment_size="1MiB", workers=workers)
        d = Daemon(tmp_path / name / "data", port, env, extra=["--listen", f"unix:{sock}"])
        made.append(d)
    return made[0], made[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_daemon_on_a_busy_port_stops(tmp_path: Path, sock_dir: Path, workers: str) -> None:
    first, second = _pair(tmp_path, workers, sock_dir / "kv.sock")
    first.start()
    try:
        _create(first.base, "before")
        message = _refused(second)
        assert "exited with 2" in message
        assert f"listen=127.0.0.1:{first.port}" in message and "cannot listen there" in message
        # The first serves every request: every tenant created through the port is in its store.
        names = [f"t{i}" for i in range(6)]
        for name in names:
            _create(first.base, name)
        for _ in range(10):  # new connections each time, whichever worker takes them
            assert _tenants(first.base) == sorted(["before", *names])
    finally:
        assert first.stop() == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_daemon_on_a_busy_unix_socket_stops(tmp_path: Path, sock_dir: Path, workers: str) -> None:
    first, second = _pair(tmp_path, workers, sock_dir / "kv.sock")
    second.port = free_port()  # the TCP address is free: only the socket is shared
    first.start()
    try:
        message = _refused(second)
        assert "exited with 2" in message
        assert f"listen=unix:{sock_dir / 'kv.sock'}: another process is listening on it" in message
        assert (sock_dir / "kv.sock").is_socket()  # the first's socket file is left alone
        _create(first.base, "after")
        assert _tenants(first.base) == ["after"]
    finally:
        assert first.stop() == 0


def test_workers_still_share_the_port(tmp_path: Path, sock_dir: Path) -> None:
    # Both workers take connections from the one inherited socket.
    first, _ = _pair(tmp_path, "2", sock_dir / "kv.sock")
    first.start()
    try:
        roles = set()
        for _ in range(200):
            with urllib.request.urlopen(first.base + "/healthz", timeout=30) as r:
                roles.add(json.loads(r.read())["role"])
            if roles == {"writer", "reader"}:
                break
        assert roles == {"writer", "reader"}
    finally:
        assert first.stop() == 0
