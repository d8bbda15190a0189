"""The gateway's records (kvstore/buckets/records.py) and the start-up
that brings the catalog in line with them (recovery.py), on a real store with
the gateway served in-process on 127.0.0.1 and driven by boto3: a catalog
lost and rebuilt, a catalog kept and reconciled, crashes between a record
and the catalog's commit, a catalog made before records existed, a rebuild
that cannot read everything, records forged over the store's own API, and
records kept as long as their objects under a tenant's quota."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from aiohttp.test_utils import TestServer
from botocore.config import Config
from botocore.exceptions import ClientError

from kvstore.buckets import catalog as catalog_mod
from kvstore.buckets import records
from kvstore.buckets.objects import new_uid
from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from kvstore.errors import TierUnavailable
from kvstore.metrics import Metrics
from kvstore.server_config import ServerConfig
from kvstore.transport.s3.gateway import make_gateway_app
from tests.http.conftest import free_port, server_config

MiB = 1 << 20
REGION = "us-east-1"


@dataclass
class Node:
    """A store and the gateway over it, which can be stopped and started
    again on the same store (the catalog file kept or removed between)."""

    cfg: ServerConfig
    store: Store
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)
    server: TestServer | None = None  # aiohttp's own runner: the gateway answers Expect with its hook
    clients: dict[str, Any] = field(default_factory=dict)

    @property
    def catalog_path(self) -> Path:
        return self.cfg.store.data_dir / "s3" / "catalog.sqlite3"

    async def start(self) -> None:
        self.server = TestServer(make_gateway_app(self.store, Metrics(), self.cfg), host="127.0.0.1", port=free_port())
        await self.server.start_server()

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.close()
        self.server = None
        for client in self.clients.values():  # their pooled sockets, before the collector finds them
            client.close()
        self.clients.clear()

    def lose_catalog(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.catalog_path) + suffix).unlink(missing_ok=True)

    async def tenant(self, name: str, policy: str = "sealed", **limits: Any) -> None:
        await self.store.create_tenant(name, policy, **limits)
        self.keys[name] = await self.store.issue_s3_key(name)

    def s3(self, tenant: str) -> Any:
        if tenant not in self.clients:
            assert self.server is not None
            akid, secret = self.keys[tenant]
            self.clients[tenant] = boto3.client(
                "s3",
                endpoint_url=f"http://127.0.0.1:{self.server.port}",
                aws_access_key_id=akid,
                aws_secret_access_key=secret,
                region_name=REGION,
                config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
            )
        return self.clients[tenant]

    async def call(self, tenant: str, op: str, **kwargs: Any) -> Any:
        """A boto3 call on a thread (the gateway runs on this loop)."""
        fn: Callable[..., Any] = getattr(self.s3(tenant), op)
        out = await asyncio.to_thread(fn, **kwargs)
        if isinstance(out, dict) and "Body" in out:
            out["Body"] = await asyncio.to_thread(out["Body"].read)
        return out

    async def record_keys(self, tenant: str) -> list[str]:
        keys, _ = await self.store.list_keys(tenant, prefix=records.PREFIX, limit=10_000)
        return [k for k, _ in keys]

    async def data_keys(self, tenant: str) -> list[str]:
        keys, _ = await self.store.list_keys(tenant, prefix="s3~", limit=10_000)
        return [k for k, _ in keys]

    def state(self) -> int:
        with sqlite3.connect(self.catalog_path) as db:
            return int(db.execute("PRAGMA user_version").fetchone()[0])


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    cfg = server_config(tmp_path / "data", s3_gateway_listen="127.0.0.1:1", max_block_size="1MiB")
    store = await Store.open(cfg.store, MasterKey(os.urandom(32)))
    n = Node(cfg, store)
    await n.tenant("acme", "sealed")
    await n.tenant("beta", "direct")
    await n.start()
    yield n
    if n.server is not None:
        await n.stop()
    await store.close()


async def object_record(node: Node, tenant: str, key: bytes) -> str:
    """The key of the one record of object ``key``."""
    found = []
    for k in await node.record_keys(tenant):
        rec = records.decode(node.store, tenant, k, await node.store.get(tenant, k))
        if isinstance(rec, records.ObjectRecord) and rec.key == key:
            found.append(k)
    assert len(found) == 1, found
    return found[0]


async def code(node: Node, tenant: str, op: str, **kwargs: Any) -> str:
    with pytest.raises(ClientError) as e:
        await node.call(tenant, op, **kwargs)
    return str(e.value.response["Error"]["Code"])


async def fill(node: Node, tenant: str, bucket: str) -> dict[str, tuple[bytes, dict[str, str], str]]:
    """A bucket with objects of every kind; what each reads back as
    (bytes, metadata, ETag), and an upload in progress on key "open"."""
    await node.call(tenant, "create_bucket", Bucket=bucket)
    out: dict[str, tuple[bytes, dict[str, str], str]] = {}
    for key, data, meta in [
        ("plain", b"small object", {"note": "first"}),
        ("dir/ünïcødé ✓ key", os.urandom(2 * MiB + 3), {"kind": "several blocks"}),
        ("empty", b"", {}),
        ("replaced", b"old version", {"v": "1"}),
        ("replaced", b"new version", {"v": "2"}),
        ("deleted", b"to be deleted", {}),
    ]:
        put = await node.call(tenant, "put_object", Bucket=bucket, Key=key, Body=data, Metadata=meta)
        out[key] = (data, meta, put["ETag"])
    await node.call(tenant, "delete_object", Bucket=bucket, Key="deleted")
    del out["deleted"]
    await node.call(tenant, "copy_object", Bucket=bucket, Key="copied", CopySource={"Bucket": bucket, "Key": "plain"})
    out["copied"] = out["plain"]
    up = (await node.call(tenant, "create_multipart_upload", Bucket=bucket, Key="done", Metadata={"mp": "yes"}))[
        "UploadId"
    ]
    p1 = os.urandom(MiB + 5)  # one part, two blocks
    e1 = (await node.call(tenant, "upload_part", Bucket=bucket, Key="done", UploadId=up, PartNumber=1, Body=p1))["ETag"]
    parts = [{"PartNumber": 1, "ETag": e1}]
    done = await node.call(
        tenant, "complete_multipart_upload", Bucket=bucket, Key="done", UploadId=up, MultipartUpload={"Parts": parts}
    )
    out["done"] = (p1, {"mp": "yes"}, done["ETag"])
    up = (await node.call(tenant, "create_multipart_upload", Bucket=bucket, Key="open", Metadata={"mp": "open"}))[
        "UploadId"
    ]
    for body in (b"first try", os.urandom(5 * MiB)):  # part 1 replaced
        await node.call(tenant, "upload_part", Bucket=bucket, Key="open", UploadId=up, PartNumber=1, Body=body)
    await node.call(tenant, "upload_part", Bucket=bucket, Key="open", UploadId=up, PartNumber=2, Body=b"end")
    return out


async def check(node: Node, tenant: str, bucket: str, expected: dict[str, tuple[bytes, dict[str, str], str]]) -> None:
    listed = await node.call(tenant, "list_objects_v2", Bucket=bucket)
    assert sorted(o["Key"] for o in listed.get("Contents", [])) == sorted(expected)
    for o in listed.get("Contents", []):
        assert (o["Size"], o["ETag"]) == (len(expected[o["Key"]][0]), expected[o["Key"]][2])
    for key, (data, meta, etag) in expected.items():
        got = await node.call(tenant, "get_object", Bucket=bucket, Key=key)
        assert (got["Body"], got["Metadata"], got["ETag"]) == (data, meta, etag), key
    assert await code(node, tenant, "head_object", Bucket=bucket, Key="deleted") == "404"


async def finish_open_upload(node: Node, tenant: str, bucket: str) -> tuple[bytes, dict[str, str], str]:
    """Complete the upload :func:`fill` left open; what "open" reads back as."""
    uploads = (await node.call(tenant, "list_multipart_uploads", Bucket=bucket)).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["open"]
    up = uploads[0]["UploadId"]
    parts = (await node.call(tenant, "list_parts", Bucket=bucket, Key="open", UploadId=up))["Parts"]
    assert [(p["PartNumber"], p["Size"]) for p in parts] == [(1, 5 * MiB), (2, 3)]
    listed = [{"PartNumber": p["PartNumber"], "ETag": p["ETag"]} for p in parts]
    await node.call(
        tenant, "complete_multipart_upload", Bucket=bucket, Key="open", UploadId=up, MultipartUpload={"Parts": listed}
    )
    got = await node.call(tenant, "get_object", Bucket=bucket, Key="open")
    assert len(got["Body"]) == 5 * MiB + 3 and got["Body"].endswith(b"end") and got["Metadata"] == {"mp": "open"}
    return got["Body"], got["Metadata"], got["ETag"]


async def test_a_lost_catalog_is_rebuilt_from_the_records(node: Node) -> None:
    """Regression (issue 24, item 3): the catalog was the only copy of the
    names; without it every object's blocks were orphans, swept at start-up."""
    acme = await fill(node, "acme", "acme-bucket")
    beta = await fill(node, "beta", "beta-bucket")
    await node.call("acme", "create_bucket", Bucket="acme-empty")
    data_before = {t: await node.data_keys(t) for t in ("acme", "beta")}
    records_before = {t: sorted(await node.record_keys(t)) for t in ("acme", "beta")}
    await node.stop()
    node.lose_catalog()
    await node.start()
    assert node.state() == catalog_mod.MIRRORED
    for tenant, bucket, expected in (("acme", "acme-bucket", acme), ("beta", "beta-bucket", beta)):
        await check(node, tenant, bucket, expected)
        assert await node.data_keys(tenant) == data_before[tenant]  # the sweep took nothing a record names
        assert sorted(await node.record_keys(tenant)) == records_before[tenant]
    names = [b["Name"] for b in (await node.call("acme", "list_buckets"))["Buckets"]]
    assert names == ["acme-bucket", "acme-empty"]
    assert await code(node, "beta", "head_bucket", Bucket="acme-bucket") == "403"  # still acme's alone
    acme["open"] = await finish_open_upload(node, "acme", "acme-bucket")
    # ... and the rebuilt catalog is the truth from now on, through another restart.
    await node.stop()
    await node.start()
    await check(node, "acme", "acme-bucket", acme)


async def test_every_change_keeps_one_record_per_row(node: Node) -> None:
    """A record per bucket, object, upload and part; replaced, deleted,
    aborted and completed ones leave none behind."""
    await fill(node, "acme", "acme-bucket")
    keys = await node.record_keys("acme")
    kinds = sorted(records.kind_of(k) or "?" for k in keys)
    # 1 bucket; plain, several-blocks, empty, replaced, copied, done; the open upload and its 2 parts
    assert kinds == sorted(["b"] + ["o"] * 6 + ["u"] + ["p"] * 2)
    up = (await node.call("acme", "list_multipart_uploads", Bucket="acme-bucket"))["Uploads"][0]["UploadId"]
    await node.call("acme", "abort_multipart_upload", Bucket="acme-bucket", Key="open", UploadId=up)
    listed = await node.call("acme", "list_objects_v2", Bucket="acme-bucket")
    await node.call(
        "acme",
        "delete_objects",
        Bucket="acme-bucket",
        Delete={"Objects": [{"Key": o["Key"]} for o in listed["Contents"]]},
    )
    await node.call("acme", "delete_bucket", Bucket="acme-bucket")
    assert await node.record_keys("acme") == []
    assert await node.data_keys("acme") == []


async def test_the_catalog_is_the_truth_while_the_disk_lives(node: Node) -> None:
    """A crash after a record is written but before the catalog names it
    (an unanswered PUT) leaves a record the next start deletes; a row whose
    record is gone gets it written again."""
    expected = await fill(node, "acme", "acme-bucket")
    stray = []  # the records of PUTs that crashed before their commit: a new version of "plain", a new object
    for key, data in ((b"plain", b"never acknowledged"), (b"ghost", b"never acknowledged")):
        rkey = records.key_of(records.OBJECT, new_uid())
        rec = records.ObjectRecord("acme-bucket", key, len(data), '"x"', 1 << 62, {}, [])
        await records.put(node.store, "acme", rkey, rec)
        stray.append(rkey)
    victim = next(k for k in await node.record_keys("acme") if records.kind_of(k) == records.BUCKET)
    assert await node.store.delete("acme", victim)  # e.g. removed by the tenant's quota
    await node.stop()
    await node.start()
    keys = await node.record_keys("acme")
    assert not set(stray) & set(keys)
    assert victim in keys
    await check(node, "acme", "acme-bucket", expected)
    # That record is what a rebuild finds.
    await node.stop()
    node.lose_catalog()
    await node.start()
    await check(node, "acme", "acme-bucket", expected)


async def test_a_crash_between_record_and_commit_when_rebuilding(node: Node) -> None:
    """Rebuilding, two records of one (bucket, key) (a crash between the new
    record and the old one's deletion): the newer wins and the other goes;
    a record naming missing blocks is left out; an upload whose parts an
    object uses was completed."""
    expected = await fill(node, "acme", "acme-bucket")
    store = node.store
    older = records.ObjectRecord("acme-bucket", b"plain", 3, '"old"', 1, {}, [])
    old_key = records.key_of(records.OBJECT, new_uid())
    await records.put(store, "acme", old_key, older)
    lost_key = records.key_of(records.OBJECT, new_uid())
    lost = records.ObjectRecord("acme-bucket", b"lost", 5, '"l"', 2, {}, [("s3~" + "ab" * 16 + "~0", 5)])
    await records.put(store, "acme", lost_key, lost)
    # "done"'s upload as it was before its Complete committed: its upload and part records.
    done = (await node.call("acme", "head_object", Bucket="acme-bucket", Key="done"))["ContentLength"]
    for key in await node.record_keys("acme"):
        rec = records.decode(store, "acme", key, await store.get("acme", key))
        if isinstance(rec, records.ObjectRecord) and rec.key == b"done":
            part = records.PartRecord("f" * 32, 1, done, '"p"', 3, rec.blocks)
            upload = records.UploadRecord("f" * 32, "acme-bucket", b"done", 3, {})
            await records.put(store, "acme", records.key_of(records.PART, new_uid()), part)
            await records.put(store, "acme", records.key_of(records.UPLOAD, new_uid()), upload)
    bucket_record = [k for k in await node.record_keys("acme") if records.kind_of(k) == records.BUCKET]
    assert len(bucket_record) == 1
    await store.delete("acme", bucket_record[0])  # e.g. its TTL: the bucket is made again from its objects
    await node.stop()
    node.lose_catalog()
    await node.start()
    await check(node, "acme", "acme-bucket", expected)
    keys = await node.record_keys("acme")
    assert old_key not in keys and lost_key not in keys and bucket_record[0] not in keys
    uploads = (await node.call("acme", "list_multipart_uploads", Bucket="acme-bucket")).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["open"]
    assert sorted(records.kind_of(k) or "?" for k in keys) == sorted(["b"] + ["o"] * 6 + ["u"] + ["p"] * 2)


async def test_a_catalog_from_before_records_gets_them(node: Node) -> None:
    """A catalog made before records existed is the truth: records are
    written for every row at the first start, and a rebuild finds them."""
    expected = await fill(node, "acme", "acme-bucket")
    await node.stop()
    for key in await node.record_keys("acme"):
        await node.store.delete("acme", key)
    with sqlite3.connect(node.catalog_path) as db:
        for table in ("buckets", "objects", "uploads", "parts"):
            db.execute(f"UPDATE {table} SET record = ''")
        db.execute("PRAGMA user_version=0")
    await node.start()
    assert node.state() == catalog_mod.MIRRORED
    assert len(await node.record_keys("acme")) == 10
    await node.stop()
    node.lose_catalog()
    await node.start()
    await check(node, "acme", "acme-bucket", expected)
    await finish_open_upload(node, "acme", "acme-bucket")


async def test_an_unfinished_rebuild_deletes_nothing(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record that cannot be read now (the object tier unreachable) leaves
    the rebuild unfinished: its object's blocks are not swept, nothing is
    deleted, and the next start rebuilds again and finds it."""
    expected = await fill(node, "acme", "acme-bucket")
    plain = await object_record(node, "acme", b"plain")
    data_before = await node.data_keys("acme")
    await node.stop()
    node.lose_catalog()
    real_get = Store.get

    async def get(self: Store, tenant: str, key: str) -> bytearray:
        if key == plain:
            raise TierUnavailable("injected: the object tier is unreachable")
        return await real_get(self, tenant, key)

    monkeypatch.setattr("kvstore.buckets.recovery.READ_ATTEMPTS", 1)
    monkeypatch.setattr(Store, "get", get)
    await node.start()
    assert node.state() == catalog_mod.REBUILDING
    assert await code(node, "acme", "head_object", Bucket="acme-bucket", Key="plain") == "404"
    assert await node.data_keys("acme") == data_before  # "plain"'s block was not taken for an orphan
    await node.call("acme", "put_object", Bucket="acme-bucket", Key="new", Body=b"written meanwhile")
    await node.stop()
    monkeypatch.setattr(Store, "get", real_get)
    await node.start()
    assert node.state() == catalog_mod.MIRRORED
    etag = (await node.call("acme", "head_object", Bucket="acme-bucket", Key="new"))["ETag"]
    expected["new"] = (b"written meanwhile", {}, etag)
    await check(node, "acme", "acme-bucket", expected)


async def test_records_forged_over_the_store_api_are_not_read(node: Node) -> None:
    """A sealed tenant that writes under the gateway's prefix itself (as a
    /v1 PUT would) cannot make a record the gateway reads: it cannot seal
    one. Such blocks are deleted, whether the catalog is kept or rebuilt;
    and a direct tenant's forged claim never takes a sealed tenant's bucket."""
    await node.call("beta", "create_bucket", Bucket="beta-bucket")
    doc = {"v": 1, "name": "beta-bucket", "region": REGION, "created": 1 << 62}
    forged = records.key_of(records.BUCKET, new_uid())
    await node.store.put("acme", forged, json.dumps(doc).encode())  # plaintext, as a client would send it
    await node.stop()
    node.lose_catalog()
    await node.start()
    assert forged not in await node.record_keys("acme")
    assert (await node.call("beta", "head_bucket", Bucket="beta-bucket"))["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert await code(node, "acme", "head_bucket", Bucket="beta-bucket") == "403"
    await node.store.put("acme", forged, json.dumps(doc).encode())
    await node.stop()
    await node.start()
    assert forged not in await node.record_keys("acme")
    # A direct tenant's records are plaintext, as its blocks are: a newer
    # claim it forges on a sealed tenant's bucket still loses to it.
    expected = await fill(node, "acme", "acme-bucket")
    doc = {"v": 1, "name": "acme-bucket", "region": REGION, "created": 1 << 62}
    await node.store.put("beta", forged, json.dumps(doc).encode())
    await node.stop()
    node.lose_catalog()
    await node.start()
    assert forged not in await node.record_keys("beta")
    await check(node, "acme", "acme-bucket", expected)
    assert await code(node, "beta", "head_bucket", Bucket="acme-bucket") == "403"


async def test_a_record_lasts_as_long_as_its_object(node: Node) -> None:
    """Under a quota's LRU, reading an object touches its record (and writes
    it again if it went): the object it names can still be rebuilt."""
    await node.tenant("small", "direct", quota_bytes=3 * MiB)
    await node.call("small", "create_bucket", Bucket="small-bucket")
    keep = os.urandom(MiB)
    await node.call("small", "put_object", Bucket="small-bucket", Key="kept", Body=keep)
    for i in range(6):  # more than the quota: the least recently used go, "kept" is read in between
        got = await node.call("small", "get_object", Bucket="small-bucket", Key="kept")
        assert got["Body"] == keep
        await node.call("small", "put_object", Bucket="small-bucket", Key=f"filler{i}", Body=os.urandom(MiB // 2))
    kept_record = await object_record(node, "small", b"kept")  # still there
    await node.store.delete("small", kept_record)  # gone anyway: the next read writes it again
    assert (await node.call("small", "get_object", Bucket="small-bucket", Key="kept"))["Body"] == keep
    assert kept_record in await node.record_keys("small")
    await node.stop()
    node.lose_catalog()
    await node.start()
    assert (await node.call("small", "get_object", Bucket="small-bucket", Key="kept"))["Body"] == keep


def test_blocks_pack_and_unpack() -> None:
    uid = "ab" * 16
    extents = [(f"s3~{uid}~{n}", 16 * MiB) for n in range(320)] + [(f"s3~{uid}~320", 5)]
    extents += [("s3~" + "cd" * 16 + "~0", 7), ("s3~odd~key~x", 3), (f"s3~{uid}~400", 1)]
    packed = records._pack_blocks(extents)
    assert len(json.dumps(packed)) < 200
    assert records._unpack_blocks(json.loads(json.dumps(packed))) == extents
    with pytest.raises(ValueError):
        records._unpack_blocks([["v1-block", 3]])  # only the objects' prefix
