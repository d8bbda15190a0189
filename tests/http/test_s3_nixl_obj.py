"""NIXL's OBJ backend against the daemon's S3 gateway, the way Dynamo KVBM's
object tier (G4) drives it: host memory (DRAM) to and from whole S3 objects.

KVBM registers each block as an OBJ descriptor whose device id is the block's
sequence hash and whose meta info is empty, so the OBJ plugin names the object
after the device id in decimal (``std::to_string(devId)``); it writes a batch
of blocks in one WRITE transfer (one PutObject per block) and reads them back
in one READ (one ranged GetObject per block, ``Range: bytes=off-end`` with the
descriptor's address as the offset). ``query_memory`` is HeadObject.

What the plugin sends (aws-sdk-cpp 1.11 over curl, SigV4, path-style, checked
on the wire against moto): PutObject with ``Content-Encoding: aws-chunked``,
``Transfer-Encoding: chunked``, ``x-amz-content-sha256:
STREAMING-UNSIGNED-PAYLOAD-TRAILER``, ``x-amz-trailer: x-amz-checksum-crc64nvme``,
``x-amz-decoded-content-length`` and ``Expect: 100-continue`` by default; with
``req_checksum=required`` a plain body whose SHA-256 is signed; with
``crtMinLimit`` objects of that size go through the CRT client: multipart
upload (parts of 8 MiB, ``UNSIGNED-PAYLOAD``, ``x-amz-mp-object-size`` on
Complete), ranged GETs of 8 MiB with ``If-Match``, request targets in absolute
form (``PUT http://host:port/bucket/key?partNumber=1&uploadId=...``).
GetObject asks ``x-amz-checksum-mode: enabled``."""

from __future__ import annotations

import ctypes
import io
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError
from kvstore_client.nixl import nixl_available
from kvstore_client.wire.nixl_loader import nixl_api

from tests.http.conftest import Daemon
from tests.s3.conftest import start_gateway

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12 nixl; tests/run.sh does)"
)

REGION = "us-east-1"
BUCKET = "kvbm-g4"
MiB = 1 << 20
BLOCK = MiB  # a KVBM block as one object
BLOCKS = 16
BIG = 24 * MiB + 12_345  # several 4 MiB daemon blocks, and not a multiple of one
XFER_TIMEOUT_S = 60.0


@dataclass
class Gateway:
    """A daemon with its S3 gateway, a tenant, the tenant's S3 key and a bucket."""

    daemon: Daemon
    s3_port: int
    access_key: str
    secret_key: str
    policy: str

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    _clients: dict[str, Any] = field(default_factory=dict)

    def client(self, secret: str | None = None) -> Any:
        """boto3, path-style, SigV4, this tenant's key (with ``secret`` if given)."""
        secret = secret or self.secret_key
        if secret not in self._clients:
            self._clients[secret] = boto3.client(
                "s3",
                endpoint_url=self.endpoint,
                region_name=REGION,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=secret,
                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=5),
            )
        return self._clients[secret]

    def obj_params(self, **overrides: str) -> dict[str, str]:
        """The OBJ backend's parameters for this gateway (names as NIXL's obj plugin reads them)."""
        return {
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "bucket": BUCKET,
            "endpoint_override": f"127.0.0.1:{self.s3_port}",
            "scheme": "http",
            "region": REGION,
            "use_virtual_addressing": "false",
            **overrides,
        }


@pytest.fixture(scope="module", params=["sealed", "direct"])
def gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, aws_env: None
) -> Iterator[Gateway]:
    policy: str = request.param
    base = start_gateway(tmp_path_factory.mktemp(f"s3-{policy}"), durability="interval")
    try:
        access_key, secret_key = base.tenant("t1", policy)
        gw = Gateway(base.daemon, base.port, access_key, secret_key, policy)
        gw.client().create_bucket(Bucket=BUCKET)
        yield gw
    finally:
        if base.daemon.proc is not None:
            base.daemon.stop()


class Obj:
    """One NIXL agent with the OBJ backend only (no UCX), and the memory it registered."""

    def __init__(self, name: str, params: dict[str, str]) -> None:
        self.api = nixl_api()
        self.agent: Any = self.api.nixl_agent(name, self.api.nixl_agent_config(backends=[]))
        assert "OBJ" in self.agent.get_plugin_list()
        self.agent.create_backend("OBJ", params)
        assert set(self.agent.get_backend_mem_types("OBJ")) >= {"DRAM_SEG", "OBJ_SEG"}
        self._held: list[bytearray] = []

    def dram(self, data: bytes | int) -> tuple[bytearray, int]:
        """A registered host buffer (held for the agent's life) and its address."""
        buf = bytearray(data)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        self.agent.register_memory([(addr, len(buf), 0, "")], "DRAM", backends=["OBJ"])
        self._held.append(buf)
        return buf, addr

    def objects(self, regs: list[tuple[int, int, str]]) -> None:
        """Register OBJ descriptors (device id, size, key); an empty key means the
        object is named after the device id, as KVBM registers its blocks."""
        self.agent.register_memory([(0, size, dev, key) for dev, size, key in regs], "OBJ", backends=["OBJ"])

    def xfer(self, op: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]) -> str:
        """One transfer, DRAM descriptors (addr, len, 0) against OBJ descriptors
        (offset, len, device id), polled to its end: "DONE" or "ERR"."""
        agent = self.agent
        handle = agent.initialize_xfer(
            op, agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "OBJ"), agent.name
        )
        failure = self.api.nixlBind.nixlBackendError
        try:
            try:
                state: str = agent.transfer(handle)
                deadline = time.monotonic() + XFER_TIMEOUT_S
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"NIXL {op} still in progress after {XFER_TIMEOUT_S} s")
                    time.sleep(0.002)
                    state = agent.check_xfer_state(handle)
            except failure:
                return "ERR"
            return state
        finally:
            agent.release_xfer_handle(handle)

    def exists(self, keys: list[str]) -> list[bool]:
        """HeadObject per key, through NIXL's query_memory (the key is the meta info)."""
        return [r is not None for r in self.agent.query_memory([(0, 0, 0, k) for k in keys], "OBJ", "OBJ")]


_agent_ids = itertools.count()


def _obj(gw: Gateway, **overrides: str) -> Obj:
    return Obj(f"kvbm-g4-{gw.policy}-{next(_agent_ids)}", gw.obj_params(**overrides))


def _hashes(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def _head_size(gw: Gateway, key: str) -> int:
    return int(gw.client().head_object(Bucket=BUCKET, Key=key)["ContentLength"])


def _get(gw: Gateway, key: str, byte_range: str | None = None) -> bytes:
    extra = {"Range": byte_range} if byte_range else {}
    body: bytes = gw.client().get_object(Bucket=BUCKET, Key=key, **extra)["Body"].read()
    return body


def test_kvbm_blocks_offload_and_onboard_whole_and_ranged(gateway: Gateway) -> None:
    rng = random.Random(f"blocks-{gateway.policy}")
    hashes = _hashes(rng, BLOCKS)
    names = [str(h) for h in hashes]  # the OBJ plugin's name for a descriptor without meta info
    obj = _obj(gateway)
    src, src_addr = obj.dram(rng.randbytes(BLOCKS * BLOCK))
    obj.objects([(h, BLOCK, "") for h in hashes])
    blocks = [(h, i * BLOCK) for i, h in enumerate(hashes)]

    # Offload: one WRITE of all blocks, one object per block.
    assert (
        obj.xfer("WRITE", [(src_addr + at, BLOCK, 0) for _, at in blocks], [(0, BLOCK, h) for h, _ in blocks]) == "DONE"
    )

    # The objects are there for any S3 client, with the block's bytes.
    assert all(_head_size(gateway, n) == BLOCK for n in names)
    assert _get(gateway, names[3]) == src[3 * BLOCK : 4 * BLOCK]
    listed = gateway.client().list_objects_v2(Bucket=BUCKET)
    sizes = {o["Key"]: o["Size"] for o in listed.get("Contents", [])}
    assert all(sizes.get(n) == BLOCK for n in names)
    assert obj.exists(names) == [True] * BLOCKS

    # Onboard: one READ of all blocks, in another order, into a fresh buffer.
    dst, dst_addr = obj.dram(BLOCKS * BLOCK)
    order = list(range(BLOCKS))
    rng.shuffle(order)
    local = [(dst_addr + i * BLOCK, BLOCK, 0) for i in order]
    assert obj.xfer("READ", local, [(0, BLOCK, hashes[i]) for i in order]) == "DONE"
    assert dst == src

    # Ranged reads: the descriptor's address is the offset into the object.
    spans = [
        (0, 0, 1),
        (1, 1, 4095),
        (2, BLOCK - 1, 1),
        (5, 65_536, 65_536),
        (9, 123_457, 700_001),
        (15, 17, BLOCK - 17),
    ]
    part, part_addr = obj.dram(sum(n for _, _, n in spans))
    local, remote, at = [], [], 0
    for i, off, n in spans:
        local.append((part_addr + at, n, 0))
        remote.append((off, n, hashes[i]))
        at += n
    assert obj.xfer("READ", local, remote) == "DONE"
    at = 0
    for i, off, n in spans:
        assert part[at : at + n] == src[i * BLOCK + off : i * BLOCK + off + n], (i, off, n)
        at += n


def test_object_larger_than_a_daemon_block(gateway: Gateway) -> None:
    """One object over several of the daemon's blocks (max_block_size 4 MiB),
    written by the default client (aws-chunked body, CRC64NVME trailer)."""
    rng = random.Random(f"big-{gateway.policy}")
    data = rng.randbytes(BIG)
    obj = _obj(gateway)
    _, src_addr = obj.dram(data)
    dev = rng.getrandbits(64)
    obj.objects([(dev, BIG, "")])
    assert obj.xfer("WRITE", [(src_addr, BIG, 0)], [(0, BIG, dev)]) == "DONE"
    assert _head_size(gateway, str(dev)) == BIG

    dst, dst_addr = obj.dram(BIG)
    assert obj.xfer("READ", [(dst_addr, BIG, 0)], [(0, BIG, dev)]) == "DONE"
    assert dst == data

    # Ranges across the 4 MiB boundaries of the daemon's blocks, and the object's tail.
    spans = [(4 * MiB - 10, 20), (8 * MiB - 1, 2), (3 * MiB, 6 * MiB + 3), (BIG - 100, 100), (0, 4 * MiB)]
    part, part_addr = obj.dram(sum(n for _, n in spans))
    local, remote, at = [], [], 0
    for off, n in spans:
        local.append((part_addr + at, n, 0))
        remote.append((off, n, dev))
        at += n
    assert obj.xfer("READ", local, remote) == "DONE"
    at = 0
    for off, n in spans:
        assert part[at : at + n] == data[off : off + n], (off, n)
        at += n
    assert _get(gateway, str(dev), f"bytes={4 * MiB - 3}-{4 * MiB + 2}") == data[4 * MiB - 3 : 4 * MiB + 3]


def test_named_objects_with_signed_payload(gateway: Gateway) -> None:
    """Objects named by the descriptor's meta info (a key with '/' in it), and the
    client's other PutObject: ``req_checksum=required`` sends a plain body whose
    SHA-256 is part of the signature."""
    rng = random.Random(f"named-{gateway.policy}")
    obj = _obj(gateway, req_checksum="required")
    blobs = {f"g4/worker-0/{rng.getrandbits(64):016x}": rng.randbytes(BLOCK + i) for i in range(3)}
    regs = [(i + 1, len(v), k) for i, (k, v) in enumerate(blobs.items())]
    obj.objects(regs)
    srcs = [obj.dram(v) for v in blobs.values()]
    assert obj.xfer("WRITE", [(a, len(b), 0) for b, a in srcs], [(0, size, dev) for dev, size, _ in regs]) == "DONE"
    for (_, size, key), data in zip(regs, blobs.values(), strict=True):
        assert _head_size(gateway, key) == size
        assert _get(gateway, key) == data
    dsts = [obj.dram(size) for _, size, _ in regs]
    assert obj.xfer("READ", [(a, len(b), 0) for b, a in dsts], [(0, size, dev) for dev, size, _ in regs]) == "DONE"
    assert [bytes(b) for b, _ in dsts] == list(blobs.values())


CRT_MIN = 5 * MiB  # crtMinLimit: transfers of this size and more go through the S3 CRT client
CRT_SIZE = 20 * MiB + 7  # three 8 MiB parts, the last one short


def test_crt_client_multipart_upload(gateway: Gateway) -> None:
    """The CRT client uploads in parts: CreateMultipartUpload, UploadPart (8 MiB,
    in parallel), CompleteMultipartUpload, each with an absolute-form request
    target (``POST http://127.0.0.1:PORT/bucket/key?uploads``)."""
    rng = random.Random(f"crt-put-{gateway.policy}")
    data = rng.randbytes(CRT_SIZE)
    obj = _obj(gateway, crtMinLimit=str(CRT_MIN))
    _, src_addr = obj.dram(data)
    dev = rng.getrandbits(64)
    obj.objects([(dev, CRT_SIZE, "")])
    assert obj.xfer("WRITE", [(src_addr, CRT_SIZE, 0)], [(0, CRT_SIZE, dev)]) == "DONE"
    assert _head_size(gateway, str(dev)) == CRT_SIZE
    assert _get(gateway, str(dev)) == data


def test_crt_client_parallel_ranged_reads(gateway: Gateway) -> None:
    """The CRT client reads in 8 MiB ranges, the first alone and the rest in
    parallel with ``If-Match`` on the ETag the first answer carried. The object
    is uploaded in parts by boto3 here, so the read does not depend on the CRT's
    own upload."""
    rng = random.Random(f"crt-get-{gateway.policy}")
    data = rng.randbytes(CRT_SIZE)
    dev = rng.getrandbits(64)
    gateway.client().upload_fileobj(
        io.BytesIO(data),
        BUCKET,
        str(dev),
        Config=TransferConfig(multipart_threshold=CRT_MIN, multipart_chunksize=8 * MiB),
    )
    assert _head_size(gateway, str(dev)) == CRT_SIZE

    obj = _obj(gateway, crtMinLimit=str(CRT_MIN))
    obj.objects([(dev, CRT_SIZE, "")])
    dst, dst_addr = obj.dram(CRT_SIZE)
    assert obj.xfer("READ", [(dst_addr, CRT_SIZE, 0)], [(0, CRT_SIZE, dev)]) == "DONE"
    assert dst == data
    # A read of crtMinLimit or more at an offset, through the CRT client too.
    tail, tail_addr = obj.dram(6 * MiB)
    assert obj.xfer("READ", [(tail_addr, 6 * MiB, 0)], [(CRT_SIZE - 6 * MiB, 6 * MiB, dev)]) == "DONE"
    assert tail == data[CRT_SIZE - 6 * MiB :]


def test_missing_objects_are_misses_and_reads_of_them_fail(gateway: Gateway) -> None:
    rng = random.Random(f"missing-{gateway.policy}")
    obj = _obj(gateway)
    present, absent = rng.getrandbits(64), rng.getrandbits(64)
    _, src_addr = obj.dram(rng.randbytes(4096))
    # Registered larger than what is written: NIXL checks descriptors against the registration only.
    obj.objects([(present, 8192, ""), (absent, 4096, "")])
    assert obj.xfer("WRITE", [(src_addr, 4096, 0)], [(0, 4096, present)]) == "DONE"
    assert obj.exists([str(present), str(absent), f"{absent}-nope"]) == [True, False, False]

    # (The client writes the error's body into the destination: only the status counts.)
    _, dst_addr = obj.dram(4096)
    assert obj.xfer("READ", [(dst_addr, 4096, 0)], [(0, 4096, absent)]) == "ERR"
    # One missing block fails the whole batch, as KVBM's onboard sees it.
    assert (
        obj.xfer("READ", [(dst_addr, 2048, 0), (dst_addr + 2048, 2048, 0)], [(0, 2048, present), (0, 2048, absent)])
        == "ERR"
    )
    # A range that starts past the end of an object: 416 from S3, a failed read.
    assert obj.xfer("READ", [(dst_addr, 10, 0)], [(4096, 10, present)]) == "ERR"
    with pytest.raises(ClientError) as e:
        gateway.client().head_object(Bucket=BUCKET, Key=str(absent))
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_wrong_secret_fails_every_transfer(gateway: Gateway) -> None:
    rng = random.Random(f"secret-{gateway.policy}")
    good = _obj(gateway)
    dev, other = rng.getrandbits(64), rng.getrandbits(64)
    data = rng.randbytes(8192)
    _, src_addr = good.dram(data)
    good.objects([(dev, len(data), "")])
    assert good.xfer("WRITE", [(src_addr, len(data), 0)], [(0, len(data), dev)]) == "DONE"

    wrong_secret = gateway.secret_key[:-4] + ("AAAA" if not gateway.secret_key.endswith("AAAA") else "BBBB")
    for params in ({"secret_key": wrong_secret}, {"access_key": "AKIA" + "X" * 16}):
        bad = _obj(gateway, **params)
        _, bad_src = bad.dram(rng.randbytes(len(data)))
        bad.objects([(dev, len(data), ""), (other, len(data), "")])
        _, dst_addr = bad.dram(len(data))
        assert bad.xfer("READ", [(dst_addr, len(data), 0)], [(0, len(data), dev)]) == "ERR"
        assert bad.xfer("WRITE", [(bad_src, len(data), 0)], [(0, len(data), other)]) == "ERR"
        assert bad.xfer("WRITE", [(bad_src, len(data), 0)], [(0, len(data), dev)]) == "ERR"
        with pytest.raises(good.api.nixlBind.nixlBackendError):  # HeadObject 403: an error, not a miss
            bad.exists([str(dev)])

    # Nothing the rejected writes sent was stored.
    assert _get(gateway, str(dev)) == data
    assert good.exists([str(dev), str(other)]) == [True, False]
    with pytest.raises(ClientError) as e:
        gateway.client(secret=wrong_secret).head_object(Bucket=BUCKET, Key=str(dev))
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
