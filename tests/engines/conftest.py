"""Engine adapter tests: a real kvstore daemon (``server.py`` as a process, the
daemon of tests/http) with a tenant, and the engines' own packages from
``.venv-engines`` (see tests/run_engines.sh)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "AWS_EC2_METADATA_DISABLED": "true",
}
for _k, _v in ENGINE_ENV.items():
    os.environ.setdefault(_k, _v)


# Warnings the engines' own imports raise (third-party code; the repository's
# pytest settings turn warnings into errors): ignored by exact message.
ENGINE_WARNINGS = (
    r"ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated:DeprecationWarning",
    # torch's own modules, imported by vllm.distributed.kv_events in this process
    r"ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in ENGINE_WARNINGS:
        config.addinivalue_line("filterwarnings", line)


@dataclass
class Kvstore:
    """A running daemon and a tenant token."""

    daemon: Daemon
    token: str = ""

    @property
    def url(self) -> str:
        return self.daemon.base

    def start(self) -> Kvstore:
        self.daemon.start()
        return self

    def stop(self) -> None:
        if self.daemon.proc is not None:
            self.daemon.stop(signal.SIGKILL)

    def create_tenant(self, name: str = "engine") -> str:
        req = urllib.request.Request(
            self.url + "/v1/admin/tenants", data=json.dumps({"name": name}).encode(), method="POST"
        )
        req.add_header("Authorization", f"Bearer {ADMIN}")
        with urllib.request.urlopen(req, timeout=10) as r:
            self.token = str(json.loads(r.read())["token"])
        return self.token

    def set_qos(self, qos: dict[str, Any], name: str = "engine") -> None:
        """PATCH the tenant's QoS fields (None: back to the store's default)."""
        req = urllib.request.Request(
            self.url + f"/v1/admin/tenants/{name}", data=json.dumps({"qos": qos}).encode(), method="PATCH"
        )
        req.add_header("Authorization", f"Bearer {ADMIN}")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    def nixl_reads(self) -> int:
        """Read calls the daemon's NIXL agent answered (0 without one)."""
        req = urllib.request.Request(self.url + "/v1/admin/status")
        req.add_header("Authorization", f"Bearer {ADMIN}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(json.loads(r.read())["nixl"].get("reads", 0))

    def blocks(self) -> int:
        req = urllib.request.Request(self.url + "/v1/stats")
        req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(json.loads(r.read())["blocks"])


def nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None


# UCX for the daemon's and the engines' NIXL agents: TCP on loopback (no RDMA here).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


def make_kvstore(workdir: Path, nixl: bool = False, **settings: str) -> Kvstore:
    """A daemon with one tenant; ``nixl``: with its NIXL agent (UCX over TCP
    on lo); ``settings``: more of its settings."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = daemon_env(workdir, segment_size="16MiB", durability="interval", **settings)
    if nixl:
        env |= {"KVSTORE_NIXL": "1", "KVSTORE_NIXL_DEVICES": "lo", **UCX_ENV}
    kv = Kvstore(Daemon(workdir / "data", free_port(), env)).start()
    kv.create_tenant()
    return kv


@pytest.fixture
def kvstore(tmp_path: Path) -> Iterator[Kvstore]:
    kv = make_kvstore(tmp_path / "kvstore")
    yield kv
    kv.stop()


def dead_endpoint() -> str:
    """A 127.0.0.1 URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"
