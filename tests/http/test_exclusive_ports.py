"""One daemon per address: a second daemon never joins a busy listener.

Used to be: with 2+ workers the listener set SO_REUSEPORT, so a second
daemon (another data directory) started on the same port said "serving",
and from then on the kernel split connections between the two stores: of
six tenants created through the port, one landed in one store and five in
the other. Then the supervisor bound each address once, without
SO_REUSEPORT, and its workers shared the socket: a pool of connections
opened at once was all accepted by whichever worker woke first. Now each
worker listens on its own SO_REUSEPORT socket, bound only after a plain bind
says nobody holds the port, and checked once the workers listen
(listeners.foreign_listeners): connections spread, and a second daemon
still stops.
"""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest

from kvstore.daemon.listeners import foreign_listeners
from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port
from tests.polling import until_now


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


def test_a_pool_of_connections_opened_at_once_spreads_over_the_workers(tmp_path: Path, sock_dir: Path) -> None:
    """32 keep-alive connections opened in one burst (as a client's pool
    does), each asked which worker it reached: both take a share (with an
    even split by the kernel's hash, fewer than 6 of 32 on one worker has a
    chance of about 1 in 10,000)."""
    first, _ = _pair(tmp_path, "2", sock_dir / "kv.sock")
    first.start()
    try:
        # start() returns once the port answers: the writer's; the reader listens a moment later.
        until_now("the supervisor's serving line", lambda: "with 2 workers" in first.log.read_text(), 60)
        conns = [socket.create_connection(("127.0.0.1", first.port), timeout=30) for _ in range(32)]
        roles: list[str] = []
        for c in conns:
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        for c in conns:
            with c, c.makefile("rb") as f:
                length = 0
                while (line := f.readline()) not in (b"\r\n", b""):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                roles.append(json.loads(f.read(length))["role"])
        counts = {r: roles.count(r) for r in ("writer", "reader")}
        assert min(counts.values()) >= 6, f"connections by worker: {counts}"
    finally:
        assert first.stop() == 0


def test_a_listener_that_joins_the_port_is_found(tmp_path: Path) -> None:
    """What the supervisor checks once its workers listen: a socket of
    another process bound with SO_REUSEPORT too (a second daemon whose
    start overlapped) is found; the daemon's own are not."""
    own = socket.socket()
    own.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    own.bind(("127.0.0.1", 0))
    own.listen()
    port = own.getsockname()[1]
    try:
        assert foreign_listeners([own]) == []
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        with other:
            assert foreign_listeners([own]) == [f"127.0.0.1:{port}"]
    finally:
        own.close()


def test_workers_still_share_the_port(tmp_path: Path, sock_dir: Path) -> None:
    # Both workers take connections on the one port.
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
