"""LMCache 0.5.6's own S3 L2 adapter (multiprocess mode's L2 tier,
``lmcache/v1/distributed/l2_adapters/s3_l2_adapter.py``) against the daemon's
S3 gateway: built the way the MP server builds it (its ``--l2-adapter`` JSON
through LMCache's argument parser and config registry, then the adapter
factory the StorageManager calls), then store, lookup-and-lock, load, unlock
and delete, with bytes compared and misses checked.

How the adapter talks S3 (awscrt's S3 client, checked on the wire against
moto): SigV4 with ``x-amz-content-sha256: UNSIGNED-PAYLOAD`` on every request;
``Host: <s3_endpoint>`` and the path ``/`` + the percent-encoded object name
``<model>@<kv_rank:08x>@<group:x>@<chunk_hash hex>[@<cache_salt>]`` (``@`` sent
as ``%40``); PutObject with Content-Length for bodies up to 8 MiB, multipart
upload above (8 MiB parts, ``x-amz-mp-object-size`` on Complete); HeadObject
for lookups (a hit needs a Content-Length over 0; 404 is a miss); GetObject in
8 MiB ranges (``Range: bytes=0-8388607`` first, then the rest in parallel with
``If-Match`` on the ETag the first answer carried); DeleteObject (200 or 204).

Addressing: the adapter knows only virtual-hosted style: ``s3_endpoint`` is
sent as the Host header and is where it connects, so the bucket's host name
must resolve. ``<bucket>.localhost`` does not resolve here (nsswitch ``hosts:
files dns``), so most tests reach the gateway path-style: the endpoint is
``127.0.0.1:PORT`` and the bucket is the object name's first ``/`` segment:
the model name ``lmcache-l2/tiny`` puts objects in bucket ``lmcache-l2`` under
keys ``tiny@...`` (a HuggingFace name ``org/model`` would use the bucket
``org``). The adapter's listing (``GET /?list-type=2``, ListObjectsV2 on the
bucket's host) needs the virtual host too: the test that uses it (with the
gateway's ``s3_gateway_domain``) runs where ``<bucket>.localhost`` resolves to
127.0.0.1 and skips, saying why, elsewhere."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from botocore.config import Config
from botocore.exceptions import ClientError
from lmcache.v1.distributed.api import ObjectKey

from tests.engines import l2
from tests.engines.l2 import chunk, empty_like, load, lookup, raw, store
from tests.http.conftest import ADMIN, ROOT, Daemon, daemon_env, free_port

# The adapter fails a request by raising from awscrt's on_done callback (every
# miss, every error): awscrt reports those as unraisable exceptions.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <awscrt\.s3\._S3RequestCore:pytest.PytestUnraisableExceptionWarning"
)

REGION = "us-east-1"
BUCKET = "lmcache-l2"
MODEL = f"{BUCKET}/tiny"  # path-style: the first segment of the object name is the bucket
KEY_PREFIX = "tiny@"  # what the gateway stores the objects under, in BUCKET
VHOST_DOMAIN = "localhost"  # the gateway's s3_gateway_domain: Host <bucket>.localhost is virtual-hosted
VHOST = f"{BUCKET}.{VHOST_DOMAIN}"
MiB = 1 << 20
# The daemon runs on the main venv's interpreter (the one tests/run.sh sets up
# with the daemon's dependencies); the engines' venv also has kvstore installed.
DAEMON_PYTHON = ROOT / ".venv" / "bin" / "python"

# KV chunks as the MP server's L1 holds them (KV_2LTD: K/V, layers, tokens, hidden), bf16.
SMALL = (2, 4, 16, 256)  # 64 KiB: one PutObject
FULL = (2, 4, 256, 1024)  # 4 MiB: one PutObject, one ranged GET
LARGE = (2, 6, 256, 1024)  # 12 MiB: multipart upload, two ranged GETs


class GatewayDaemon(Daemon):
    """``server.py`` on :data:`DAEMON_PYTHON` (the shared ``Daemon`` uses this
    process's interpreter, the engines' venv)."""

    def start(self, timeout: float = 30) -> None:
        python = DAEMON_PYTHON if DAEMON_PYTHON.exists() else Path(sys.executable)
        cmd = [str(python), str(ROOT / "server.py"), "--data-dir", str(self.data_dir)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", *self.extra]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        _wait_port(self.port, self, timeout)


def _wait_port(port: int, daemon: Daemon, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert daemon.proc is not None
        if daemon.proc.poll() is not None:
            raise RuntimeError(f"server exited with {daemon.proc.returncode}: {daemon.log.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@dataclass
class Gateway:
    """A daemon with its S3 gateway, a tenant, the tenant's S3 key and a bucket."""

    daemon: Daemon
    s3_port: int
    access_key: str
    secret_key: str

    _client: Any = None

    def client(self) -> Any:
        """boto3, path-style, SigV4, the tenant's key."""
        if self._client is None:
            self._client = boto3.client(
                "s3",
                endpoint_url=f"http://127.0.0.1:{self.s3_port}",
                region_name=REGION,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=5),
            )
        return self._client

    def spec(self, **overrides: Any) -> dict[str, Any]:
        """The adapter's ``--l2-adapter`` JSON object for this gateway."""
        return {
            "type": "s3",
            "s3_endpoint": f"127.0.0.1:{self.s3_port}",
            "s3_region": REGION,
            "disable_tls": True,
            "s3_prefer_http2": False,  # ALPN needs TLS
            "s3_num_io_threads": 2,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            **overrides,
        }


def _admin_post(base: str, path: str, doc: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(base + path, data=json.dumps(doc or {}).encode(), method="POST")
    req.add_header("Authorization", f"Bearer {ADMIN}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201, r.status
        return json.loads(r.read())


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, aws_env: None) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("lmcache-s3")
    s3_port = free_port()
    env = daemon_env(
        workdir,
        s3_gateway_listen=f"127.0.0.1:{s3_port}",
        s3_gateway_domain=VHOST_DOMAIN,
        segment_size="16MiB",
        durability="interval",
    )
    daemon = GatewayDaemon(workdir / "data", free_port(), env)
    daemon.start()
    try:
        _wait_port(s3_port, daemon)
        _admin_post(daemon.base, "/v1/admin/tenants", {"name": "lmcache", "policy": "sealed"})
        keys = _admin_post(daemon.base, "/v1/admin/tenants/lmcache/s3-keys")
        gw = Gateway(daemon, s3_port, keys["access_key_id"], keys["secret_access_key"])
        gw.client().create_bucket(Bucket=BUCKET)
        yield gw
    finally:
        if daemon.proc is not None:
            daemon.stop(signal.SIGKILL)


def make_adapter(spec: dict[str, Any]) -> Any:
    return l2.make_adapter(spec, "S3L2Adapter")


@pytest.fixture
def adapters(gateway: Gateway) -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for a in made:
        a.close()


def key(n: int, *, rank: int = 0, group: int = 0, salt: str = "", model: str = MODEL) -> Any:
    return ObjectKey(
        chunk_hash=n.to_bytes(32, "big"), model_name=model, kv_rank=rank, object_group_id=group, cache_salt=salt
    )


def object_name(k: Any) -> str:
    """The key the gateway stores ``k`` under in :data:`BUCKET` (LMCache's object name less the bucket)."""
    base = f"{KEY_PREFIX}{k.kv_rank:08x}@{k.object_group_id:x}@{k.chunk_hash.hex()}"
    return f"{base}@{k.cache_salt}" if k.cache_salt else base


def head_size(gw: Gateway, name: str) -> int | None:
    try:
        return int(gw.client().head_object(Bucket=BUCKET, Key=name)["ContentLength"])
    except ClientError as e:
        if e.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
            return None
        raise


def test_store_lookup_load_roundtrip(gateway: Gateway, adapters: list[Any]) -> None:
    writer = make_adapter(gateway.spec())
    adapters.append(writer)
    keys = [key(0x100 + i) for i in range(3)] + [key(0x200, rank=3, group=1, salt="user-7"), key(0x300)]
    objs = [chunk(FULL, 1), chunk(FULL, 2), chunk(SMALL, 3), chunk(FULL, 4), chunk(LARGE, 5)]
    result = store(writer, keys, objs)
    assert result.is_successful(), int(result)
    assert result.bytes_transferred() == sum(o.get_size() for o in objs)

    # What the gateway holds: one object per chunk, its bytes the chunk's.
    for k, o in zip(keys, objs, strict=True):
        assert head_size(gateway, object_name(k)) == o.get_size(), object_name(k)
    got = gateway.client().get_object(Bucket=BUCKET, Key=object_name(keys[3]))["Body"].read()
    assert got == raw(objs[3])

    # Another adapter (another MP server on the same bucket, or this one
    # restarted): its lookups are HeadObject calls, not its own size cache.
    reader = make_adapter(gateway.spec())
    adapters.append(reader)
    missing = [key(0xDEAD), key(0x100, rank=1), key(0x200, rank=3, group=1, salt="user-8")]
    assert lookup(reader, keys + missing, objs) == [True] * len(keys) + [False] * len(missing)

    dst = [empty_like(o) for o in objs]
    assert load(reader, keys, dst) == [True] * len(keys)
    for k, o, d in zip(keys, objs, dst, strict=True):
        assert raw(d) == raw(o), object_name(k)
        assert torch.equal(d.tensor, o.tensor)
    reader.submit_unlock(keys)

    # Loads of chunks that are not there fail per key, the others still load.
    mixed = [keys[2], missing[0], keys[0]]
    out = [empty_like(objs[2]), empty_like(objs[2]), empty_like(objs[0])]
    assert load(reader, mixed, out) == [True, False, True]
    assert raw(out[0]) == raw(objs[2]) and raw(out[2]) == raw(objs[0])


def test_restore_overwrites_and_delete_respects_locks(gateway: Gateway, adapters: list[Any]) -> None:
    a = make_adapter(gateway.spec())
    adapters.append(a)
    k = key(0x400)
    first, second = chunk(FULL, 10), chunk(FULL, 11)
    assert store(a, [k], [first]).is_successful()
    assert store(a, [k], [second]).is_successful()  # same key again: the object is replaced
    b = make_adapter(gateway.spec())
    adapters.append(b)
    assert lookup(b, [k]) == [True]
    d = empty_like(second)
    assert load(b, [k], [d]) == [True]
    assert raw(d) == raw(second)

    # A locked key (looked up, not yet unlocked) survives delete; unlocked, it goes.
    b.delete([k])
    assert head_size(gateway, object_name(k)) == second.get_size()
    b.submit_unlock([k])
    b.delete([k])
    assert head_size(gateway, object_name(k)) is None
    fresh = make_adapter(gateway.spec())
    adapters.append(fresh)
    assert lookup(fresh, [k]) == [False]
    assert load(fresh, [k], [empty_like(second)]) == [False]


def test_wrong_secret_stores_nothing_and_finds_nothing(gateway: Gateway, adapters: list[Any]) -> None:
    good = make_adapter(gateway.spec())
    adapters.append(good)
    k, obj = key(0x500), chunk(SMALL, 20)
    assert store(good, [k], [obj]).is_successful()

    secret = gateway.secret_key
    wrong = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    for creds in ({"aws_secret_access_key": wrong}, {"aws_access_key_id": "AKIA" + "X" * 16}):
        bad = make_adapter(gateway.spec(**creds))
        adapters.append(bad)
        other = key(0x501)
        assert not store(bad, [other], [chunk(SMALL, 21)]).is_successful()
        assert head_size(gateway, object_name(other)) is None
        assert not store(bad, [k], [chunk(SMALL, 22)]).is_successful()
        assert lookup(bad, [k, other]) == [False, False]  # a 403 is no hit
        assert load(bad, [k], [empty_like(obj)]) == [False]
        assert bad.report_status()["is_healthy"]  # 403 is not a connection failure

    # The chunk the rejected writes aimed at is intact.
    d = empty_like(obj)
    assert load(good, [k], [d]) == [True]
    assert raw(d) == raw(obj)


def test_unreachable_gateway_is_a_miss(gateway: Gateway, adapters: list[Any]) -> None:
    """An endpoint where nothing listens: the store fails, the lookup misses,
    within the CRT client's retries."""
    a = make_adapter(gateway.spec(s3_endpoint=f"127.0.0.1:{free_port()}"))
    adapters.append(a)
    k, obj = key(0x600), chunk(SMALL, 30)
    assert not store(a, [k], [obj]).is_successful()
    assert lookup(a, [k]) == [False]


def _virtual_host_unusable() -> str | None:
    """Why the adapter cannot reach the gateway virtual-hosted here, or None."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(VHOST, None)}
    except socket.gaierror as e:
        return (
            f"{VHOST} does not resolve on this host ({e.strerror}): LMCache's S3L2Adapter sends its "
            "s3_endpoint as the Host header and connects to it, so virtual-hosted addressing and "
            "its listing (GET /?list-type=2 on the bucket's host) need <bucket>.<domain> to resolve "
            "to the gateway"
        )
    if found != {"127.0.0.1"}:
        return f"{VHOST} resolves to {sorted(found)}, not only to 127.0.0.1 where the gateway listens"
    return None


def test_virtual_hosted_endpoint_and_listing(gateway: Gateway, adapters: list[Any]) -> None:
    """The adapter as documented: the bucket in the endpoint's host
    (``s3://<bucket>.<domain>:port``, the gateway's ``s3_gateway_domain``), a
    HuggingFace-style model name with a '/', and ``list_l2_keys`` paging through
    ListObjectsV2 with ``prefix=<model>@`` and continuation tokens."""
    reason = _virtual_host_unusable()
    if reason:
        pytest.skip(reason)
    spec = gateway.spec(s3_endpoint=f"s3://{VHOST}:{gateway.s3_port}")
    model = "org/tiny-vh"
    writer = make_adapter(spec)
    adapters.append(writer)
    keys = [key(0x700 + i, model=model) for i in range(3)] + [key(0x7FF, model=model, salt="user-1")]
    objs = [chunk(SMALL, 40), chunk(FULL, 41), chunk(LARGE, 42), chunk(SMALL, 43)]
    assert store(writer, keys, objs).is_successful()
    for k, o in zip(keys, objs, strict=True):
        name = f"{model}@{k.kv_rank:08x}@{k.object_group_id:x}@{k.chunk_hash.hex()}"
        name += f"@{k.cache_salt}" if k.cache_salt else ""
        assert head_size(gateway, name) == o.get_size(), name  # the whole object name is the key

    reader = make_adapter(spec)
    adapters.append(reader)
    assert lookup(reader, [*keys, key(0x7FE, model=model)]) == [True] * len(keys) + [False]
    dst = [empty_like(o) for o in objs]
    assert load(reader, keys, dst) == [True] * len(keys)
    assert [raw(d) for d in dst] == [raw(o) for o in objs]
    reader.submit_unlock(keys)

    listed: dict[Any, int] = {}
    cursor = None
    for _ in range(len(keys) + 1):
        page = reader.list_l2_keys(model_name=model, page_size=1, cursor=cursor)
        assert len(page.entries) <= 1
        listed |= {e.key: e.size_bytes for e in page.entries}
        cursor = page.next_page_token
        if cursor is None:
            break
    assert cursor is None
    assert listed == {k.to_encoded_object_key(): o.get_size() for k, o in zip(keys, objs, strict=True)}
    assert reader.list_l2_keys(model_name="org/other").entries == ()
