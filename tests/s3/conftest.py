"""A real daemon with its S3 gateway on 127.0.0.1, tenants with access keys,
and boto3 clients signing real SigV4 requests."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port

REGION = "us-east-1"


@dataclass
class Gateway:
    daemon: Daemon
    port: int
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # tenant -> (access key id, secret)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(
            self.daemon.base + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": "Bearer " + ADMIN},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def tenant(self, name: str, policy: str = "sealed", **limits: Any) -> tuple[str, str]:
        self.admin("POST", "/v1/admin/tenants", {"name": name, "policy": policy, **limits})
        key = self.admin("POST", f"/v1/admin/tenants/{name}/s3-keys")
        self.keys[name] = (key["access_key_id"], key["secret_access_key"])
        return self.keys[name]

    def client(self, tenant: str | None = None, key: tuple[str, str] | None = None, **config: Any) -> Any:
        akid, secret = key if key is not None else self.keys[tenant or ""]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=akid,
            aws_secret_access_key=secret,
            region_name=REGION,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                **config,
            ),
        )


def start_gateway(workdir: Path, **settings: str) -> Gateway:
    port = free_port()
    env = daemon_env(
        workdir,
        segment_size="4MiB",
        frame_size="64KiB",
        max_block_size="4MiB",
        s3_gateway_listen=f"127.0.0.1:{port}",
        **settings,
    )
    daemon = Daemon(workdir / "data", free_port(), env)
    daemon.start()
    gw = Gateway(daemon, port)
    _wait_listening(port)
    return gw


def _wait_listening(port: int) -> None:
    import socket
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("the S3 gateway did not start listening")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One daemon for a module: a sealed tenant ``acme`` and a direct one
    ``beta``, each with an access key."""
    gw = start_gateway(tmp_path_factory.mktemp("s3gw"))
    gw.tenant("acme", "sealed")
    gw.tenant("beta", "direct")
    yield gw
    gw.daemon.stop()
