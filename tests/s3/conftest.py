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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """botocore drops a pooled connection now and then without closing its
    socket (after an error answer, with ``Expect: 100-continue``), and the
    collector finds it in whichever test runs then. Those sockets are this
    process's, the client's: the daemon under test is another process, so
    this hides no leak of kvstore's."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"))


@dataclass
class Gateway:
    daemon: Daemon
    port: int
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # tenant -> (access key id, secret)
    # Every boto3 client made here, closed by close(): a client collected while its pool holds a
    # socket warns (ResourceWarning) in whichever later test the collector happens to run.
    clients: list[Any] = field(default_factory=list)

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
        client = boto3.client(
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
        self.clients.append(client)
        return client

    def close(self) -> None:
        """Close the clients' pooled connections, then stop the daemon."""
        for client in self.clients:
            client.close()
        self.clients.clear()
        self.daemon.stop()


def start_gateway(workdir: Path, extra_env: dict[str, str] | None = None, **settings: str) -> Gateway:
    """A daemon with its gateway; ``settings`` as KVSTORE_<NAME> variables,
    ``extra_env`` as they are (an object tier's AWS_* variables)."""
    port = free_port()
    env = daemon_env(
        workdir,
        segment_size="4MiB",
        frame_size="64KiB",
        max_block_size="4MiB",
        s3_gateway_listen=f"127.0.0.1:{port}",
        **settings,
    )
    env.update(extra_env or {})
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
    gw.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def code(self) -> str | None:
        import xml.etree.ElementTree as ET

        if not self.body:
            return None
        found = ET.fromstring(self.body).find("Code")
        return found.text if found is not None else None


def send_signed(
    gw: Gateway,
    method: str,
    path: str,
    key: tuple[str, str],
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    payload_hash: str | None = None,
    send_body: bytes | None = None,
    extra_headers: dict[str, str] | None = None,
    region: str = REGION,
    host: str | None = None,
) -> Answer:
    """A request signed by botocore's own SigV4 signer (``payload_hash``: the
    x-amz-content-sha256 to sign instead of the body's), then sent as is,
    or with ``send_body`` and ``extra_headers`` swapped in after signing."""
    import http.client

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    class Signer(S3SigV4Auth):  # type: ignore[misc]
        def payload(self, request: Any) -> str:
            return payload_hash if payload_hash is not None else str(super().payload(request))

    base = f"http://{host}" if host is not None else gw.endpoint
    req = AWSRequest(method=method, url=base + path, data=body, headers=dict(headers or {}))
    Signer(Credentials(*key), "s3", region).add_auth(req)
    out_headers = {k: str(v) for k, v in req.headers.items()}
    data = body if send_body is None else send_body
    out_headers["Content-Length"] = str(len(data))
    out_headers.update(extra_headers or {})
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
    try:
        conn.request(method, path, body=data, headers=out_headers)
        resp = conn.getresponse()
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def http_error(fn: Any, *args: Any) -> tuple[int, bytes]:
    """(status, body) of the HTTPError ``fn(*args)`` raises; the response closed."""
    import urllib.error

    try:
        fn(*args)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()
    raise AssertionError("expected an HTTP error")
