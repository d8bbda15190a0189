"""The gateway under maintenance and failure: overwrites read concurrently
while compaction and flushes run, no plaintext of a sealed tenant on disk,
restarts (clean and SIGKILL), orphaned blocks swept, TTL and quota eviction,
tenant deletion, virtual-host addressing, several workers."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from kvstore.config import StoreConfig
from kvstore.engine.crypto import load_master_key
from kvstore.engine.store import Store
from tests.http.conftest import ADMIN
from tests.s3.conftest import Gateway, send_signed, start_gateway
from tests.s3.test_gateway_ops import code_of, fresh_bucket

MiB = 1 << 20


@pytest.fixture
def gw(tmp_path: Path) -> Any:
    g = start_gateway(tmp_path)
    yield g
    if g.daemon.proc is not None:
        g.daemon.stop(signal.SIGKILL)


def v1(gw: Gateway, method: str, path: str, token: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        gw.daemon.base + path, method=method, data=body, headers={"Authorization": "Bearer " + token}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def test_overwrites_read_while_compaction_and_flush_run(gw: Gateway) -> None:
    """Writers replace objects (one to several blocks) while readers GET them
    whole and by range and the admin compacts and flushes: every read is
    exactly one version a writer sent, never a mix or another object's
    bytes; at the end each object is its last acknowledged version and no
    block of a replaced version is left behind."""
    for tenant, policy in (("acme", "sealed"), ("beta", "direct")):
        gw.tenant(tenant, policy)
    stop = threading.Event()
    errors: list[str] = []
    versions: dict[tuple[str, str], dict[str, bytes]] = {}  # (tenant, key) -> md5 -> bytes, before the PUT starts
    last: dict[tuple[str, str], str] = {}
    lock = threading.Lock()
    buckets = {t: fresh_bucket(gw.client(t)) for t in ("acme", "beta")}
    keys = [f"obj{i}" for i in range(4)]

    def writer(tenant: str, owned: list[str], seed: int) -> None:
        s3, rng = gw.client(tenant), random.Random(seed)
        while not stop.is_set():
            key = rng.choice(owned)
            data = os.urandom(rng.choice([100_000, 3 * MiB, 5 * MiB + 17]))
            digest = hashlib.md5(data).hexdigest()
            with lock:
                versions.setdefault((tenant, key), {})[digest] = data
            try:
                s3.put_object(Bucket=buckets[tenant], Key=key, Body=data)
            except ClientError as e:
                errors.append(f"put {tenant}/{key}: {e}")
                return
            with lock:
                last[(tenant, key)] = digest

    def reader(tenant: str, seed: int) -> None:
        s3, rng = gw.client(tenant), random.Random(seed)
        while not stop.is_set():
            key = rng.choice(keys)
            with lock:  # a PUT acknowledged before this GET starts: the key must be found
                acknowledged = (tenant, key) in last
            try:
                if rng.random() < 0.5:
                    body = s3.get_object(Bucket=buckets[tenant], Key=key)["Body"].read()
                    ok = hashlib.md5(body).hexdigest() in versions.get((tenant, key), {})
                else:
                    first = rng.randrange(0, 100_000)
                    got = s3.get_object(Bucket=buckets[tenant], Key=key, Range=f"bytes={first}-{first + 4 * MiB}")
                    body = got["Body"].read()
                    ok = any(
                        v[first : first + 4 * MiB + 1] == body for v in list(versions.get((tenant, key), {}).values())
                    )
            except ClientError as e:
                ok = code_of_client(e) == "NoSuchKey" and not acknowledged
            if not ok:
                errors.append(f"read {tenant}/{key}: bytes of no version")

    def maintenance() -> None:
        while not stop.is_set():
            for path in ("/v1/admin/compact", "/v1/admin/flush"):
                status, body = v1(gw, "POST", path, ADMIN, b"")
                if status != 200:
                    errors.append(f"{path}: {status} {body[:200]!r}")
            time.sleep(0.2)

    threads = [
        threading.Thread(target=writer, args=(t, keys[i::2], 10 * n + i))
        for n, t in enumerate(("acme", "beta"))
        for i in range(2)
    ]
    threads += [threading.Thread(target=reader, args=(t, 100 + i)) for i, t in enumerate(("acme", "beta", "acme"))]
    threads.append(threading.Thread(target=maintenance))
    for t in threads:
        t.start()
    time.sleep(8)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:5]
    for tenant in ("acme", "beta"):
        s3 = gw.client(tenant)
        total_blocks = 1  # the bucket's record (kvstore/buckets/records.py)
        for key in keys:
            digest = last[(tenant, key)]
            assert hashlib.md5(s3.get_object(Bucket=buckets[tenant], Key=key)["Body"].read()).hexdigest() == digest
            size = len(versions[(tenant, key)][digest])
            total_blocks += -(-size // (4 * MiB)) + 1  # its blocks and its record
        info = gw.admin("GET", f"/v1/admin/tenants/{tenant}")
        assert info["blocks"] == total_blocks, (tenant, info["blocks"], total_blocks)  # nothing leaked


def code_of_client(e: ClientError) -> str:
    return str(e.response["Error"]["Code"])


def test_sealed_tenant_leaves_no_plaintext_on_disk(gw: Gateway) -> None:
    """An object of a sealed tenant (its bytes, metadata, content type, and
    an unfinished upload's) is nowhere on disk in the clear: not in its
    segments, the index, the catalog (and its WAL) or the registry."""
    marker = b"PLAINTEXT-MARKER-" + os.urandom(8).hex().encode()

    def files_with_marker() -> list[Path]:
        return [p for p in gw.daemon.data_dir.rglob("*") if p.is_file() and marker in p.read_bytes()]

    def put_everything(tenant: str) -> None:
        s3 = gw.client(tenant)
        bucket = fresh_bucket(s3)
        s3.put_object(
            Bucket=bucket,
            Key="k",
            Body=marker * 1000,
            Metadata={"note": marker.decode()},
            ContentType="text/" + marker.decode(),
        )
        up = s3.create_multipart_upload(Bucket=bucket, Key="mp", Metadata={"note": marker.decode()})["UploadId"]
        s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=1, Body=marker * 10)
        assert v1(gw, "POST", "/v1/admin/flush", ADMIN, b"")[0] == 200

    gw.tenant("acme", "sealed")
    put_everything("acme")
    assert files_with_marker() == []
    # The scan finds the same things stored for a direct tenant: it is not blind.
    gw.tenant("beta", "direct")
    put_everything("beta")
    assert files_with_marker() != []


def _put_behind_the_gateway(gw: Gateway, tenant: str, key: str, data: bytes) -> None:
    """Store a block with the daemon stopped, through the engine itself."""
    from tests.s3.conftest import _wait_listening

    gw.close()

    async def put() -> None:
        cfg = StoreConfig.from_env(gw.daemon.data_dir, env=gw.daemon.env)
        store = await Store.open(cfg, load_master_key(gw.daemon.env["KVSTORE_MASTER_KEY_FILE"]), background=False)
        try:
            await store.put(tenant, key, data)
        finally:
            await store.close()

    asyncio.run(put())
    gw.daemon.start()
    _wait_listening(gw.port)


def test_restart_and_sigkill_keep_objects_and_sweep_orphans(gw: Gateway) -> None:
    gw.tenant("acme", "sealed")
    token = gw.admin("POST", "/v1/admin/tenants/acme/tokens")["token"]
    s3 = gw.client("acme")
    bucket = fresh_bucket(s3)
    data = {f"k{i}": os.urandom(random.choice([10, 5 * MiB])) for i in range(6)}
    for k, v in data.items():
        s3.put_object(Bucket=bucket, Key=k, Body=v)
    up = s3.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
    p1 = os.urandom(5 * MiB)
    e1 = s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=1, Body=p1)["ETag"]
    # A crash between storing an object's blocks and naming them leaves blocks no object names
    # (written here behind the gateway's back: /v1 refuses its prefixes).
    assert v1(gw, "PUT", "/v1/blocks/s3~" + "ab" * 16 + "~0", token, b"orphan")[0] == 400
    _put_behind_the_gateway(gw, "acme", "s3~" + "ab" * 16 + "~0", b"orphan")
    assert v1(gw, "PUT", "/v1/blocks/unrelated", token, b"a /v1 block")[0] == 201
    for how in (signal.SIGTERM, signal.SIGKILL):
        gw.daemon.stop(how)
        gw.daemon.start()
        from tests.s3.conftest import _wait_listening

        _wait_listening(gw.port)
        s3 = gw.client("acme")
        for k, v in data.items():
            assert s3.get_object(Bucket=bucket, Key=k)["Body"].read() == v
        assert [p["PartNumber"] for p in s3.list_parts(Bucket=bucket, Key="mp", UploadId=up)["Parts"]] == [1]
    assert v1(gw, "GET", "/v1/blocks/s3~" + "ab" * 16 + "~0", token)[0] == 404  # swept at start-up
    assert v1(gw, "GET", "/v1/blocks/unrelated", token) == (200, b"a /v1 block")
    s3.complete_multipart_upload(
        Bucket=bucket, Key="mp", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e1}]}
    )
    assert s3.get_object(Bucket=bucket, Key="mp")["Body"].read() == p1


def test_ttl_and_quota_make_objects_misses_never_wrong_bytes(gw: Gateway) -> None:
    gw.tenant("short", "direct", ttl_s=1)
    s3 = gw.client("short")
    bucket = fresh_bucket(s3)
    s3.put_object(Bucket=bucket, Key="old", Body=b"x" * 1000)
    time.sleep(2.2)
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="old")
    assert code_of(e) == "NoSuchKey"
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 0
    gw.tenant("small", "direct", quota_bytes=7 * MiB)
    s3 = gw.client("small")
    bucket = fresh_bucket(s3)
    first = os.urandom(5 * MiB)
    s3.put_object(Bucket=bucket, Key="first", Body=first)
    second = os.urandom(5 * MiB)
    s3.put_object(Bucket=bucket, Key="second", Body=second)  # over the quota: the least recently used blocks go
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert listed == ["second"]
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="first")
    assert code_of(e) == "NoSuchKey"
    assert s3.get_object(Bucket=bucket, Key="second")["Body"].read() == second


def test_objects_are_the_tenants_blocks_with_events_and_metrics(gw: Gateway) -> None:
    gw.tenant("acme", "sealed")
    s3 = gw.client("acme")
    bucket = fresh_bucket(s3)
    before = gw.admin("GET", "/v1/admin/tenants/acme")
    s3.put_object(Bucket=bucket, Key="blockish", Body=os.urandom(9 * MiB))
    after = gw.admin("GET", "/v1/admin/tenants/acme")
    assert after["blocks"] - before["blocks"] == 4  # 4 + 4 + 1 MiB (the store's block size here) and its record
    with urllib.request.urlopen(gw.daemon.base + "/metrics") as r:
        text = r.read().decode()
    assert 'kvstore_s3_requests_total{op="PutObject",status="200"}' in text
    stored = [line for line in text.splitlines() if line.startswith('kvstore_events_total{kind="stored"}')]
    assert stored and float(stored[0].split()[-1]) >= 3  # the blocks' residency events


def test_deleted_tenant_loses_keys_and_buckets(gw: Gateway) -> None:
    gw.tenant("acme", "sealed")
    s3 = gw.client("acme")
    bucket = fresh_bucket(s3)
    s3.put_object(Bucket=bucket, Key="k", Body=b"old tenant's bytes")
    gw.admin("DELETE", "/v1/admin/tenants/acme")
    with pytest.raises(ClientError) as e:
        s3.list_buckets()
    assert code_of(e) == "InvalidAccessKeyId"
    gw.tenant("acme", "sealed")  # the same name again: another tenant
    s3 = gw.client("acme")
    assert s3.list_buckets()["Buckets"] == []
    s3.create_bucket(Bucket=bucket)  # the name is free again
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="k")
    assert code_of(e) == "NoSuchKey"


def test_virtual_host_addressing(tmp_path: Path) -> None:
    g = start_gateway(tmp_path, s3_gateway_domain="s3.kv.internal")
    try:
        g.tenant("acme", "sealed")
        s3 = g.client("acme")
        s3.create_bucket(Bucket="vhost")
        key = g.keys["acme"]
        host = f"vhost.s3.kv.internal:{g.port}"
        put = send_signed(g, "PUT", "/dir/obj", key, body=b"virtual", host=host, headers={"Host": host})
        assert put.status == 200, put.body
        assert s3.get_object(Bucket="vhost", Key="dir/obj")["Body"].read() == b"virtual"
        got = send_signed(g, "GET", "/dir/obj", key, host=host, headers={"Host": host})
        assert (got.status, got.body) == (200, b"virtual")
        listed = send_signed(g, "GET", "/?list-type=2", key, host=host, headers={"Host": host})
        assert b"<Key>dir/obj</Key>" in listed.body
    finally:
        g.close()


def test_two_workers(tmp_path: Path) -> None:
    """The gateway runs in the writer; readers serve /v1 from the same files."""
    g = start_gateway(tmp_path, workers="2")
    try:
        g.tenant("acme", "direct")
        token = g.admin("POST", "/v1/admin/tenants/acme/tokens")["token"]
        s3 = g.client("acme")
        bucket = fresh_bucket(s3)
        data = os.urandom(6 * MiB)
        s3.put_object(Bucket=bucket, Key="w", Body=data)
        assert s3.get_object(Bucket=bucket, Key="w")["Body"].read() == data
        for _ in range(4):  # either worker answers /v1
            assert v1(g, "GET", "/v1/admin/tenants/acme", ADMIN)[0] == 200
        assert token
    finally:
        g.close()
