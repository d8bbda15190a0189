"""Two edges of a fleet an operator meets, on three real daemons (moto's S3,
two workers each, a heartbeat of 4 s so that nothing here waits for one):

- a write of a key a node does not own is refused ``421 misdirected`` with
  the owner's URL in ``Kvstore-Owner`` (never stored where the fleet never
  looks), and the fleet client follows it;
- a tenant created on one node is served by every node at once: a node
  that does not know a token checks the fleet's registry then and there
  (its writer; a reader worker relays the request to it).

Used to be: a PUT to a node that did not own the key answered 201 and was
stored where no fleet client would ever read it; a new tenant was unknown
on the other nodes for up to one heartbeat, and the fleet client's
``put_many`` of 30 blocks right after the tenant's creation stored 9 of
them, with no error.
"""

from __future__ import annotations

import itertools
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from kvstore_client import AsyncClient
from kvstore_client.sharding import normalize, rank_endpoints

from ..http.conftest import free_port
from ..moto_s3 import S3Env
from .test_daemons import Fleet, call

pytestmark = pytest.mark.slow


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    doc: object


def http(base: str, method: str, path: str, token: str, data: bytes | None = None) -> Answer:
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    try:
        doc: object = json.loads(raw) if raw else None
    except ValueError:
        doc = raw
    return Answer(status, headers, doc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, s3: S3Env) -> Iterator[Fleet]:
    slow = {"s3_refresh_s": "60", "fleet_heartbeat_s": "4", "fleet_dead_after_s": "12"}
    f = Fleet(tmp_path_factory.mktemp("edges"), s3, 3, **slow)
    for d in f.nodes:  # and each node's S3 gateway
        d.env["KVSTORE_S3_GATEWAY_LISTEN"] = f"127.0.0.1:{free_port()}"
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _urls(f: Fleet) -> list[str]:
    return sorted(normalize(d.base) for d in f.nodes)


def _owned(f: Fleet, node: int, tag: str, n: int = 1) -> list[str]:
    """``n`` keys the fleet places on ``node``."""
    return list(itertools.islice(f.keys_on(f.nodes[node], tag), n))


def _tenant(f: Fleet, name: str, node: int = 0) -> str:
    made = call(f.nodes[node].base, "POST", "/v1/admin/tenants", doc={"name": name})
    assert made.status == 201, made
    return str(made.body["token"])  # type: ignore[index]


def test_a_write_to_a_node_that_does_not_own_the_key_is_refused_naming_the_owner(fleet: Fleet) -> None:
    f = fleet
    token = _tenant(f, "placed")
    n0 = f.nodes[0]
    theirs = _owned(f, 1, "theirs")[0]
    ours = _owned(f, 0, "ours")[0]
    for _ in range(4):  # both workers of node 0 (a reader relays writes to its writer)
        refused = http(n0.base, "PUT", f"/v1/blocks/{theirs}", token, b"x" * 4096)
        assert refused.status == 421, refused
        assert refused.headers["Kvstore-Owner"] == normalize(f.nodes[1].base)
        assert refused.doc["error"]["code"] == "misdirected"  # type: ignore[index]
        assert http(n0.base, "DELETE", f"/v1/blocks/{theirs}", token).status == 421
    assert http(n0.base, "GET", f"/v1/blocks/{theirs}", token).status == 404  # nothing was stored here
    # A client placing by a newer membership than this node has seen (during a change) is not refused:
    # the node's view may still list a member the fleet has declared dead.
    version = f.view(n0)["version"]
    newer = urllib.request.Request(
        n0.base + f"/v1/blocks/{theirs}",
        data=b"n" * 100,
        method="PUT",
        headers={"Authorization": f"Bearer {token}", "Kvstore-Fleet-Version": str(version + 1)},
    )
    with urllib.request.urlopen(newer, timeout=10) as r:
        assert r.status == 201
    same = http(n0.base, "PUT", f"/v1/blocks/{_owned(f, 1, 'same')[0]}", token, b"s" * 100)
    assert same.status == 421  # (without the header, or with the node's own version: refused)
    assert http(n0.base, "PUT", f"/v1/blocks/{ours}", token, b"y" * 4096).status == 201
    # A batch answers per item: the owner's key stored, the other's refused with its owner.
    from kvstore_client.wire import batchframe

    body = b"".join(bytes(p) for p in batchframe.put_stream_parts([(ours + "b", b"1" * 10), (theirs, b"2" * 10)], None))
    req = urllib.request.Request(
        n0.base + "/v1/batch/put",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": batchframe.CONTENT_TYPE},
    )
    urls = _urls(f)
    with urllib.request.urlopen(req, timeout=10) as r:
        results = json.loads(r.read())["results"]
    by_key = {x["key"]: x for x in results}
    assert by_key[theirs]["status"] == 421 and by_key[theirs]["owner"] == normalize(f.nodes[1].base)
    want = 201 if rank_endpoints(urls, ours + "b")[0] == normalize(n0.base) else 421
    assert by_key[ours + "b"]["status"] == want


async def test_the_fleet_client_follows_a_refused_write_to_the_owner(fleet: Fleet) -> None:
    f = fleet
    token = _tenant(f, "follow")
    async with AsyncClient([f.nodes[0].base], token, fleet=True, strict=True, fleet_refresh_s=3600) as kv:
        assert await kv.put("warm-up", b"w")  # reads the membership
        # A stale view (a membership read before two nodes joined): every key placed on node 0.
        kv._shards.urls = [normalize(f.nodes[0].base)]
        assert kv._fleet is not None
        kv._fleet.version = 0
        keys = [f"blk-{i}" for i in range(30)]
        results = await kv.put_many([(k, k.encode() * 100) for k in keys])
        assert results == [True] * 30
        one = _owned(f, 2, "single")[0]
        assert await kv.put(one, b"z" * 5000)
    urls = _urls(f)
    for k in [*keys, one]:  # each block is on its owner, where every fleet client reads it
        owner = rank_endpoints(urls, k)[0]
        got = http(owner, "GET", f"/v1/blocks/{k}", token)
        assert got.status == 200, (k, owner, got.status)


async def test_a_new_tenant_is_served_by_every_node_at_once(fleet: Fleet) -> None:
    f = fleet
    for r in range(3):
        token = _tenant(f, f"fresh{r}", node=r % 3)
        # The first requests after the answer, on the other nodes, on every worker.
        for i, d in enumerate(f.nodes):
            key = _owned(f, i, f"fresh{r}")[0]
            assert http(d.base, "PUT", f"/v1/blocks/{key}", token, b"f" * 2048).status == 201, d.base
            for _ in range(4):
                assert http(d.base, "GET", "/v1/stats", token).status == 200
    # The fleet client's put_many right after a creation: every block stored.
    token = _tenant(f, "batch", node=2)
    async with AsyncClient([f.nodes[0].base], token, fleet=True, strict=True) as kv:
        results = await kv.put_many([(f"b{i}", b"b" * 1000) for i in range(30)])
    assert results == [True] * 30
    # A token no node has issued is still refused, by every worker of every node.
    for d in f.nodes:
        for _ in range(4):
            bad = http(d.base, "GET", "/v1/stats", "kvs_no-such-token-of-any-tenant-0123456789")
            assert bad.status == 401 and bad.doc["error"]["code"] == "unauthorized"  # type: ignore[index]


def test_an_s3_key_issued_on_one_node_signs_on_every_node_at_once(fleet: Fleet) -> None:
    f = fleet
    _tenant(f, "s3t", node=1)
    made = call(f.nodes[1].base, "POST", "/v1/admin/tenants/s3t/s3-keys")
    assert made.status == 201, made
    akid, secret = made.body["access_key_id"], made.body["secret_access_key"]  # type: ignore[index]
    for i, d in enumerate(f.nodes):  # the first request on each node's gateway, no retry
        client = boto3.client(
            "s3",
            endpoint_url=f"http://{d.env['KVSTORE_S3_GATEWAY_LISTEN']}",
            aws_access_key_id=akid,
            aws_secret_access_key=secret,
            region_name="us-east-1",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )
        try:
            assert client.list_buckets()["Buckets"] is not None, i
            with pytest.raises(ClientError) as e:  # a key no node issued is still refused
                boto3.client(
                    "s3",
                    endpoint_url=f"http://{d.env['KVSTORE_S3_GATEWAY_LISTEN']}",
                    aws_access_key_id="AKIANOSUCHKEY0000000",
                    aws_secret_access_key=secret,
                    region_name="us-east-1",
                    config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
                ).list_buckets()
            assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
        finally:
            client.close()
