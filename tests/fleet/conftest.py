"""The fleet tests' fixtures: a real etcd for membership on leases."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..http.conftest import free_port
from .etcd_server import NO_ETCD, EtcdServer, healthy


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip(NO_ETCD)
    client, peer = free_port(), free_port()
    server = EtcdServer(client)
    log = (tmp_path / "etcd.log").open("wb")
    cmd = [
        binary,
        "--name=t",
        f"--data-dir={tmp_path / 'etcd'}",
        f"--listen-client-urls={server.url}",
        f"--advertise-client-urls={server.url}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=t=http://127.0.0.1:{peer}",
        "--heartbeat-interval=50",
        "--election-timeout=500",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not healthy(server.url):
            assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "etcd did not become healthy in 20 s"
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
