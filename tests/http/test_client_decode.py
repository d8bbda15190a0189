"""Client-side decode: ``GET /v1/records/{key}`` sends the stored frames with
the record's own key; the client checks and decodes them itself.

Byte-identical to the daemon's decoding for every range shape, both policies
and every codec; a tampered record raises (checksum, GCM tag, identity);
refused over plain TCP from a non-loopback address (a network namespace of
our own); the daemon sends the frames with sendfile and never decodes them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import xxhash
from kvstore_client import AsyncClient, CorruptBlock
from kvstore_client import record as client_record
from kvstore_client.wire import envelope

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey

from ..conftest import kv_sample
from .conftest import ADMIN, ROOT, Daemon, KVTestServer, free_port, server_config

FRAME = 64 << 10  # the test servers' frame_size
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


def _ranges(size: int) -> list[tuple[int, int] | None]:
    """Every range shape: none, whole, first and last byte, within a frame,
    across frame boundaries, ends past the block."""
    shapes: list[tuple[int, int] | None] = [
        None,
        (0, size),
        (0, 1),
        (size - 1, size),
        (FRAME - 1, FRAME + 1),
        (FRAME, 2 * FRAME),
        (1000, 3 * FRAME + 17),
        (size // 2, size),
        (17, size + 500),
        (2 * FRAME + 5, 2 * FRAME + 9),
    ]
    return [r for r in shapes if r is None or r[0] < size]


async def _tenant(session: aiohttp.ClientSession, base: str, name: str, **fields: Any) -> str:
    async with session.post(f"{base}/v1/admin/tenants", json={"name": name, **fields}, headers=ADMIN_H) as r:
        assert r.status == 201, await r.text()
        token: str = (await r.json())["token"]
    return token


async def _metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.fixture
async def served(tmp_path: Path) -> Any:
    cfg = server_config(tmp_path / "data")
    server = KVTestServer(make_app(cfg, MasterKey(os.urandom(32))), host="127.0.0.1", port=free_port())
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}", cfg
    await server.close()


BLOCKS = {
    "bf16": kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 5 * FRAME + 321],  # zstd-bp2 frames
    "odd": kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 3 * FRAME + 1],  # an odd tail byte
    "noise": random.Random(1).randbytes(2 * FRAME + 77),  # incompressible: raw frames
    "tiny": b"x" * 10,
}


@pytest.mark.parametrize(
    ("policy", "compression"),
    [("direct", None), ("sealed", "zstd-bp2"), ("sealed", "zstd"), ("sealed", "none")],
)
async def test_client_decode_is_byte_identical_to_the_daemons(served: Any, policy: str, compression: str) -> None:
    base, _ = served
    fields: dict[str, Any] = {"policy": policy} | ({"compression": compression} if compression else {})
    async with aiohttp.ClientSession() as session:
        token = await _tenant(session, base, "t", **fields)
        server_side = AsyncClient(base, token, decode="server", strict=True)
        client_side = AsyncClient(base, token, decode="client", strict=True, decode_threads=3)
        async with server_side, client_side:
            for k, v in BLOCKS.items():
                assert await server_side.put(k, v)
            for k, v in BLOCKS.items():
                for rng in _ranges(len(v)):
                    if rng is None:
                        mine, theirs = await client_side.get(k), await server_side.get(k)
                        want = v
                    else:
                        mine, theirs = await client_side.get_range(k, *rng), await server_side.get_range(k, *rng)
                        want = v[rng[0] : rng[1]]
                    assert mine == theirs == want, (k, rng)
                buf = bytearray(len(v) + 3)
                assert await client_side.get_into(k, buf) == len(v)
                assert bytes(buf[: len(v)]) == v
            assert await client_side.get("absent") is None
            assert await client_side.get_range("tiny", 10, 20) is None  # past the end: a miss
        assert client_side.stats["client_decodes"] > 0
        assert server_side.stats["client_decodes"] == 0


async def _envelope(session: aiohttp.ClientSession, base: str, token: str, key: str, rng: str | None = None) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} | ({"Range": rng} if rng else {})
    async with session.get(f"{base}/v1/records/{key}", headers=headers) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"] == "application/vnd.kvstore.record"
        assert r.headers["Cache-Control"] == "no-store"
        return await r.read()


async def _put(session: aiohttp.ClientSession, base: str, token: str, key: str, data: bytes) -> None:
    async with session.put(f"{base}/v1/blocks/{key}", data=data, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 201, await r.text()


def _split(env: bytes) -> tuple[dict[str, Any], bytes]:
    at = envelope.HEAD.size
    n = envelope.meta_len(env[:at])
    return json.loads(env[at : at + n]), env[at + n :]


def _open(meta: dict[str, Any], frames: bytes, key: str) -> bytes:
    m = client_record.parse_meta(json.dumps(meta).encode(), key)
    out = bytearray(m.end - m.start)
    opener = client_record.RecordOpener(m, memoryview(out))
    at = 0
    for j, f in enumerate(m.frames):
        opener.place(j, frames[at : at + f.length])
        at += f.length
    return bytes(out)


async def test_the_envelope_carries_the_records_key_not_the_tenants(served: Any) -> None:
    base, _ = served
    data = BLOCKS["bf16"]
    async with aiohttp.ClientSession() as session:
        token = await _tenant(session, base, "s", policy="sealed")
        await _put(session, base, token, "a", data)
        await _put(session, base, token, "b", data)
        meta_a, frames_a = _split(await _envelope(session, base, token, "a"))
        meta_b, _ = _split(await _envelope(session, base, token, "b"))
        part, frames_p = _split(await _envelope(session, base, token, "a", f"bytes={FRAME + 3}-{2 * FRAME + 9}"))
    assert meta_a["sealed"] and len(base64.b64decode(meta_a["frame_key"])) == 32
    assert meta_a["frame_key"] != meta_b["frame_key"]  # one key per record: the same bytes, other keys
    assert {f["codec"] for f in meta_a["frames"]} == {"zstd-bp2"}
    assert len(frames_a) == sum(f["len"] for f in meta_a["frames"]) < len(data)  # stored (compressed) bytes
    assert _open(meta_a, frames_a, "a") == data
    # A range gets only the frames that cover it.
    assert (part["first"], len(part["frames"]), part["start"], part["end"]) == (1, 2, FRAME + 3, 2 * FRAME + 10)
    assert _open(part, frames_p, "a") == data[FRAME + 3 : 2 * FRAME + 10]


async def test_a_tampered_record_raises_never_returns_bytes(served: Any) -> None:
    base, cfg = served
    data = BLOCKS["bf16"]
    async with aiohttp.ClientSession() as session:
        token = await _tenant(session, base, "s", policy="sealed")
        await _put(session, base, token, "a", data)
        meta, frames = _split(await _envelope(session, base, token, "a"))
    n0 = meta["frames"][0]["len"]

    def flipped(at: int) -> bytes:
        return frames[:at] + bytes([frames[at] ^ 1]) + frames[at + 1 :]

    # A flipped byte: its checksum fails.
    with pytest.raises(CorruptBlock, match="checksum"):
        _open(meta, flipped(100), "a")
    # The same byte with a checksum to match: the GCM tag fails.
    forged = json.loads(json.dumps(meta))
    forged["frames"][0]["xxh3"] = f"{xxhash.xxh3_64_intdigest(flipped(100)[:n0]):016x}"
    with pytest.raises(CorruptBlock, match="authentication"):
        _open(forged, flipped(100), "a")
    # Identity is bound: another tenant, key version, size, or frames swapped with their entries.
    for field, value in (("tenant", "other"), ("key_version", 2)):
        with pytest.raises(CorruptBlock, match="authentication"):
            _open(meta | {field: value}, frames, "a")
    swapped = meta | {"frames": [meta["frames"][1], meta["frames"][0], *meta["frames"][2:]]}
    n1 = meta["frames"][1]["len"]
    with pytest.raises(CorruptBlock, match="authentication"):
        _open(swapped, frames[n0 : n0 + n1] + frames[:n0] + frames[n0 + n1 :], "a")
    # A record of another key is refused before anything is opened.
    with pytest.raises(CorruptBlock, match="asked for block b"):
        _open(meta, frames, "b")

    # On disk: the client raises (strict) or misses (fail-open); never wrong bytes.
    seg = next((cfg.store.data_dir / "segments" / "s").glob("*.seg"))
    raw = bytearray(seg.read_bytes())
    raw[raw.index(frames[:64]) + 500] ^= 0x40
    seg.write_bytes(raw)
    async with AsyncClient(base, token, decode="client", strict=True) as kv:
        with pytest.raises(CorruptBlock):
            await kv.get("a")
        with pytest.raises(CorruptBlock):
            await kv.get_into("a", bytearray(len(data)))
    async with AsyncClient(base, token, decode="client") as kv:
        assert await kv.get("a") is None and kv.stats["errors"] == 1


async def test_the_daemon_sends_stored_frames_with_sendfile_and_decodes_nothing(daemon: Daemon, tmp_path: Path) -> None:
    sock = str(tmp_path / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}"]
    daemon.start()
    data = kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 3 << 20]
    async with aiohttp.ClientSession() as session:
        token = await _tenant(session, daemon.base, "s", policy="sealed")
        async with AsyncClient(daemon.base, token, decode="server", strict=True) as kv:
            assert await kv.put("b", data)
        before = await _metric(session, daemon.base, "kvstore_http_sendfile_bytes_total")
        for endpoint in (daemon.base, f"unix:{sock}"):
            async with AsyncClient(endpoint, token, decode="auto", strict=True) as kv:
                assert await kv.get("b") == data
                buf = bytearray(len(data))
                assert await kv.get_into("b", buf) == len(data) and buf == data
                # On the unix socket get_into reads the stored frames through a read plan.
                unix = endpoint.startswith("unix:")
                assert (kv.stats["client_decodes"], kv.stats["plan_reads"]) == ((1, 1) if unix else (2, 0))
        assert await _metric(session, daemon.base, "kvstore_http_sendfile_bytes_total") > before
    assert daemon.stop() == 0


_NETNS_CHECK = r"""
import asyncio, json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", "10.99.0.1/32", "dev", "lo"], check=True)
from pathlib import Path
import aiohttp
from kvstore_client import AsyncClient
from kvstore.engine.crypto import MasterKey
from kvstore.daemon.app import make_app
from tests.http.conftest import ADMIN, KVTestServer, server_config

DATA = bytes(range(256)) * 1000

async def relay(port, upstream):
    # A TCP relay on 127.0.0.1 (a proxy in front of the daemon): the daemon sees its address, 10.99.0.1.
    async def pipe(r, w):
        try:
            while chunk := await r.read(1 << 16):
                w.write(chunk)
                await w.drain()
        finally:
            w.close()
    async def conn(cr, cw):
        ur, uw = await asyncio.open_connection(upstream, 8765, local_addr=(upstream, 0))
        await asyncio.gather(pipe(cr, uw), pipe(ur, cw), return_exceptions=True)
    return await asyncio.start_server(conn, "127.0.0.1", port)

async def main():
    out = {}
    for host in ("10.99.0.1", "127.0.0.1"):
        cfg = server_config(Path(sys.argv[2]) / host)
        server = KVTestServer(make_app(cfg, MasterKey(os.urandom(32))), host=host, port=8765)
        await server.start_server()
        base = f"http://{host}:8765"
        async with aiohttp.ClientSession() as s:
            h = {"Authorization": f"Bearer {ADMIN}"}
            body = {"name": "t" + host[-1], "policy": "sealed"}
            async with s.post(base + "/v1/admin/tenants", json=body, headers=h) as r:
                token = (await r.json())["token"]
            h = {"Authorization": "Bearer " + token}
            async with s.put(base + "/v1/blocks/k", data=DATA, headers=h) as r:
                assert r.status == 201
            async with s.get(base + "/v1/records/k", headers=h) as r:
                out[host] = [r.status, (await r.json())["error"] if r.status != 200 else None]
            async with s.get(base + "/v1/blocks/k", headers=h) as r:
                out[host].append(r.status)
        if host == "10.99.0.1":  # auto, through the relay: refused, then the daemon decodes
            proxy = await relay(8766, host)
            async with AsyncClient("http://127.0.0.1:8766", token, decode="auto", strict=True) as kv:
                got = [await kv.get("k") == DATA, await kv.get("k") == DATA]
                ep = next(iter(kv._x.endpoints.values()))
                out["auto"] = got + [kv.stats["client_decodes"], ep.client_decode]
            proxy.close()
        await server.close()
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None, reason="needs unshare and ip")
def test_refused_over_plain_tcp_from_a_non_loopback_address(tmp_path: Path) -> None:
    """In a network namespace of our own, a daemon on 10.99.0.1 (a
    non-loopback address) refuses to send a record with its key over plain
    TCP and still serves GET; on 127.0.0.1 it sends it. A client in auto
    mode behind a proxy (its URL loopback, the daemon's peer not) falls back
    to the daemon's decoding."""
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {probe.stderr.decode().strip()}")
    script = tmp_path / "check.py"
    script.write_text(_NETNS_CHECK)
    run = subprocess.run(
        ["unshare", "-rn", sys.executable, str(script), str(ROOT), str(tmp_path / "data")],
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr.decode()
    out = json.loads(run.stdout.decode().strip().splitlines()[-1])
    status, error, get_status = out["10.99.0.1"]
    assert (status, error["code"], get_status) == (403, "insecure_transport", 200)
    assert "TLS, a unix socket or loopback" in error["message"]
    assert out["127.0.0.1"] == [200, None, 200]
    assert out["auto"] == [True, True, 0, False]


def test_the_client_refuses_client_decode_where_keys_would_cross_the_network() -> None:
    with pytest.raises(ValueError, match="decode='client' needs TLS"):
        AsyncClient("http://10.1.2.3:8080", "t", decode="client")
    # auto decodes here only where it may; TLS, unix sockets and loopback qualify.
    kv = AsyncClient(
        ["http://10.1.2.3:8080", "https://10.1.2.4", "unix:/tmp/x.sock", "http://localhost:1", "http://[::1]:2"],
        "t",
        decode="auto",
    )
    assert [ep.client_decode for ep in kv._x.endpoints.values()] == [False, True, True, True, True]
    asyncio.run(kv.close())


async def test_auto_leaves_a_direct_tenant_to_the_daemon_after_one_record(served: Any) -> None:
    """A direct tenant's frames are raw and unsealed: the daemon decodes
    nothing for it, so auto goes back to GET (one copy fewer in the client)."""
    base, _ = served
    async with aiohttp.ClientSession() as session:
        token = await _tenant(session, base, "d", policy="direct")
    async with AsyncClient(base, token, decode="auto", strict=True) as kv:
        assert await kv.put("a", BLOCKS["bf16"])
        assert await kv.get("a") == BLOCKS["bf16"]
        assert await kv.get("a") == BLOCKS["bf16"]
        assert kv.stats["client_decodes"] == 1
        assert not next(iter(kv._x.endpoints.values())).client_decode
