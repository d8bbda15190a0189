"""server.py as operators run it: start-up contract, curl, SIGTERM, kill -9, TLS."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import json
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kvstore_client.wire import batchframe

from tests.http.conftest import ADMIN, ROOT, Daemon


def _curl(*args: str) -> tuple[int, str]:
    out = subprocess.run(["curl", "-s", "-S", "-w", "\n%{http_code}", *args], capture_output=True, check=True)
    body, _, code = out.stdout.decode(errors="replace").rpartition("\n")
    return int(code), body


async def _ready(base: str, session: aiohttp.ClientSession, timeout: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            async with session.get(base + "/readyz") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("not ready")


async def _tenant_token(base: str, session: aiohttp.ClientSession, name: str = "t") -> str:
    async with session.post(
        base + "/v1/admin/tenants", json={"name": name}, headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        assert r.status == 201, await r.text()
        token: str = (await r.json())["token"]
        return token


@pytest.mark.skipif(not Path("/usr/bin/curl").exists(), reason="curl is not installed")
def test_startup_contract_and_curl(daemon: Daemon) -> None:
    daemon.start()
    code, _ = _curl(f"{daemon.base}/readyz")
    assert code == 200
    code, body = _curl(
        "-X",
        "POST",
        "-H",
        f"Authorization: Bearer {ADMIN}",
        "-d",
        '{"name": "acme"}',
        f"{daemon.base}/v1/admin/tenants",
    )
    assert code == 201
    token = json.loads(body)["token"]
    auth = ["-H", f"Authorization: Bearer {token}"]
    code, _ = _curl("-X", "PUT", *auth, "--data-binary", "0123456789", f"{daemon.base}/v1/blocks/k1")
    assert code == 201
    code, body = _curl(*auth, f"{daemon.base}/v1/blocks/k1")
    assert (code, body) == (200, "0123456789")
    code, body = _curl(*auth, "-r", "2-4", f"{daemon.base}/v1/blocks/k1")
    assert (code, body) == (206, "234")
    code, body = _curl(*auth, "-r", "20-30", f"{daemon.base}/v1/blocks/k1")
    assert code == 416 and json.loads(body)["error"]["code"] == "range_not_satisfiable"
    code, body = _curl("-I", *auth, f"{daemon.base}/v1/blocks/k1")
    assert code == 200 and "content-length: 10" in body.lower()
    code, body = _curl("-X", "POST", *auth, "-d", '{"keys": ["k1", "k2"]}', f"{daemon.base}/v1/lookup")
    assert json.loads(body) == {"prefix": 1, "present": [True, False]}
    code, _ = _curl("-X", "DELETE", *auth, f"{daemon.base}/v1/blocks/k1")
    assert code == 204
    code, body = _curl(f"{daemon.base}/metrics")
    assert code == 200 and "kvstore_http_requests_total" in body
    assert daemon.stop(signal.SIGTERM) == 0
    assert "stopped" in daemon.output


async def test_sigterm_finishes_in_flight_and_sigkill_loses_nothing_acked(daemon: Daemon) -> None:
    daemon.start()
    async with aiohttp.ClientSession() as s:
        await _ready(daemon.base, s)
        token = await _tenant_token(daemon.base, s)
        h = {"Authorization": f"Bearer {token}"}
        acked: dict[str, bytes] = {}

        async def writer(w: int) -> None:
            i = 0
            while True:
                key = f"w{w}-{i}"
                data = hashlib.sha256(key.encode()).digest() * (1000 + (i * 37) % 3000)
                try:
                    async with s.put(f"{daemon.base}/v1/blocks/{key}", data=data, headers=h) as r:
                        if r.status == 201:
                            acked[key] = data
                except (TimeoutError, aiohttp.ClientError):
                    return
                i += 1

        tasks = [asyncio.create_task(writer(w)) for w in range(8)]
        await asyncio.sleep(1.5)
        assert len(acked) > 10
        daemon.stop(signal.SIGKILL)  # mid-upload
        await asyncio.gather(*tasks)
        daemon.start()
        await _ready(daemon.base, s)
        for key, data in acked.items():
            async with s.get(f"{daemon.base}/v1/blocks/{key}", headers=h) as r:
                assert r.status == 200 and await r.read() == data, key
        # SIGTERM while requests are in flight: each one completes or is refused, none is cut off.
        tasks = [asyncio.create_task(writer(100 + w)) for w in range(4)]
        await asyncio.sleep(0.5)
        before = len(acked)
        assert daemon.stop(signal.SIGTERM) == 0
        await asyncio.gather(*tasks)
        daemon.start()
        await _ready(daemon.base, s)
        assert len(acked) > before
        for key, data in acked.items():
            async with s.get(f"{daemon.base}/v1/blocks/{key}", headers=h) as r:
                assert r.status == 200 and await r.read() == data, key
        async with s.post(daemon.base + "/v1/admin/verify", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert (await r.json())["ok"] is True
    daemon.stop()


def _self_signed(tmp: Path) -> tuple[Path, Path]:

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_path.chmod(0o600)
    return cert_path, key_path


async def test_tls(daemon: Daemon, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    daemon.extra = ["--tls-cert", str(cert), "--tls-key", str(key)]
    daemon.start()
    ctx = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
        await _ready(daemon.base, s)
        async with s.get(daemon.base + "/healthz") as r:
            assert r.status == 200
    async with aiohttp.ClientSession() as s:  # plain HTTP to a TLS port fails
        with pytest.raises(aiohttp.ClientError):
            async with s.get(f"http://127.0.0.1:{daemon.port}/healthz") as r:
                await r.read()
    daemon.stop()


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--segment-size", "tiny"], {}, "--segment-size='tiny'"),
        (["--listen", "nowhere"], {}, "HOST:PORT"),
        (["--durability", "maybe"], {}, "durability"),
        ([], {"KVSTORE_WORKERS": "0"}, "KVSTORE_WORKERS"),
        ([], {"KVSTORE_MASTER_KEY_FILE": "/nonexistent/key"}, "master key file"),
        (["--max-buffered-body-bytes", "lots"], {}, "--max-buffered-body-bytes='lots'"),
        ([], {"KVSTORE_MAX_BUFFERED_BODY_BYTES": "1MiB"}, "below max_block_size"),
    ],
)
def test_bad_config_stops_startup(daemon: Daemon, args: list[str], env: dict[str, str], needle: str) -> None:
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(daemon.data_dir), *args]
    out = subprocess.run(cmd, env={**daemon.env, **env}, capture_output=True, timeout=60)
    assert out.returncode == 2
    assert needle in out.stderr.decode()


def test_unknown_toml_key_stops_startup(daemon: Daemon, tmp_path: Path) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text('segment_size = "64MiB"\nsegmnet_size = 1\n')
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(daemon.data_dir), "--config", str(cfg)]
    out = subprocess.run(cmd, env=daemon.env, capture_output=True, timeout=60)
    assert out.returncode == 2 and "unknown key 'segmnet_size'" in out.stderr.decode()


async def test_two_workers_share_the_port_and_the_store(daemon: Daemon) -> None:
    daemon.extra = ["--workers", "2"]
    daemon.start()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        await _ready(daemon.base, s)
        adm = {"Authorization": f"Bearer {ADMIN}"}
        async with s.post(daemon.base + "/v1/admin/tenants", json={"name": "t"}, headers=adm) as r:
            assert r.status == 201
            token = (await r.json())["token"]
        h = {"Authorization": f"Bearer {token}"}
        blocks = {f"k{i}": hashlib.sha256(str(i).encode()).digest() * (500 + i) for i in range(40)}
        # New connections each time: either worker may accept each of them,
        # so writes arrive at the reader too and are forwarded to the writer.
        for k, v in blocks.items():
            async with s.put(f"{daemon.base}/v1/blocks/{k}", data=v, headers=h) as r:
                assert r.status == 201, await r.text()
                assert r.headers["ETag"]
        for k, v in blocks.items():
            async with s.get(f"{daemon.base}/v1/blocks/{k}", headers=h) as r:
                assert r.status == 200 and await r.read() == v
            async with s.get(f"{daemon.base}/v1/blocks/{k}", headers={**h, "Range": "bytes=0-9"}) as r:
                assert r.status == 206 and await r.read() == v[:10]
        async with s.post(daemon.base + "/v1/lookup", json={"keys": ["k0", "k1", "nope"]}, headers=h) as r:
            assert (await r.json())["prefix"] == 2
        async with s.put(f"{daemon.base}/v1/blocks/bad%2Fkey", data=b"x", headers=h) as r:
            assert r.status == 400
        # A revoked token fails on every worker.
        async with s.post(daemon.base + "/v1/admin/tenants/t/tokens", headers=adm) as r:
            extra = await r.json()
        async with s.delete(f"{daemon.base}/v1/admin/tenants/t/tokens/{extra['token_id']}", headers=adm) as r:
            assert r.status == 204
        for _ in range(10):
            async with s.get(f"{daemon.base}/v1/stats", headers={"Authorization": f"Bearer {extra['token']}"}) as r:
                assert r.status == 401
        seen = set()
        for _ in range(30):
            async with s.get(daemon.base + "/healthz") as r:
                doc = await r.json()
                seen.add((doc["role"], doc["pid"]))
        assert {role for role, _ in seen} == {"writer", "reader"}, f"connections went to {seen} only"
    assert daemon.stop(signal.SIGTERM) == 0
    daemon.extra = []
    daemon.start()  # the single-process daemon finds everything the two workers wrote
    async with aiohttp.ClientSession() as s:
        await _ready(daemon.base, s)
        for k, v in blocks.items():
            async with s.get(f"{daemon.base}/v1/blocks/{k}", headers=h) as r:
                assert await r.read() == v
    daemon.stop()


def test_workers_do_not_outlive_a_killed_supervisor(daemon: Daemon) -> None:
    daemon.extra = ["--workers", "2"]
    daemon.start()
    assert daemon.proc is not None
    deadline = time.monotonic() + 30
    children: list[int] = []
    while time.monotonic() < deadline and len(children) < 2:
        out = subprocess.run(["pgrep", "-P", str(daemon.proc.pid)], capture_output=True, text=True)
        children = [int(x) for x in out.stdout.split()]
        time.sleep(0.1)
    assert len(children) == 2
    daemon.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
        time.sleep(0.1)
    assert alive == [], "workers outlived their supervisor"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


async def test_stalled_clients_time_out(daemon: Daemon) -> None:
    daemon.env = {**daemon.env, "KVSTORE_KEEPALIVE_TIMEOUT_S": "1", "KVSTORE_REQUEST_TIMEOUT_S": "1"}
    daemon.start()
    async with aiohttp.ClientSession() as s:
        await _ready(daemon.base, s)
        token = await _tenant_token(daemon.base, s)
    loop = asyncio.get_running_loop()
    # Headers that never finish: the connection is closed, not held.
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n")
    t0 = loop.time()
    assert await asyncio.wait_for(reader.read(), 15) == b""
    assert loop.time() - t0 < 10
    writer.close()
    # A body that stalls: 408, and nothing is stored.
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(
        f"PUT /v1/blocks/slow HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Content-Length: 100000\r\n\r\n".encode()
        + b"x" * 10
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 15)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    async with (
        aiohttp.ClientSession() as s,
        s.head(daemon.base + "/v1/blocks/slow", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 404
    daemon.stop()


async def test_stalled_batch_body_times_out_and_reports_what_landed(daemon: Daemon) -> None:
    daemon.env = {**daemon.env, "KVSTORE_REQUEST_TIMEOUT_S": "1"}
    daemon.start()
    async with aiohttp.ClientSession() as s:
        await _ready(daemon.base, s)
        token = await _tenant_token(daemon.base, s)
    first = batchframe.encode_put_stream([("a", b"1" * 1000)])[: -len(batchframe.END)]
    body = first + batchframe.put_item_header("b", 1000) + b"2" * 10  # then nothing more
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.port)
    writer.write(
        f"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {len(body) + 5000}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    doc = json.loads(payload)
    assert doc["results"] == [{"key": "a", "status": 201}]
    daemon.stop()
