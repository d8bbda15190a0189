"""Direct blocks go out with sendfile(2) from the segment file; the bytes are
those the mapping path sends, for every range shape, and a corrupt frame is
an error, never sent. In-process servers (asyncio's loop) and the daemon
(uvloop), on TCP and on a unix socket."""

from __future__ import annotations

import io
import os
import random
import re
from pathlib import Path

import aiohttp
import pytest

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey

from ..conftest import kv_sample
from .conftest import ADMIN, Api, Daemon, KVTestServer, free_port, server_config

FRAME = 64 << 10  # the test servers' frame_size
BIG = 3 * (1 << 20) + 12_345  # more than a loopback socket takes at once: the rest goes through the transport


def _ranges(size: int) -> list[str | None]:
    """Range headers of every shape: none, whole, first and last bytes,
    frame boundaries and spans, suffixes, open ends."""
    shapes: list[str | None] = [None, f"bytes=0-{size - 1}", "bytes=0-0", f"bytes={size - 1}-{size - 1}"]
    shapes += [f"bytes={FRAME - 1}-{FRAME}", f"bytes={FRAME}-{2 * FRAME - 1}", f"bytes=1000-{3 * FRAME + 17}"]
    shapes += ["bytes=-1", "bytes=-70000", f"bytes={size // 2}-", f"bytes=0-{size + 500}"]
    return shapes


def _expect(data: bytes, rng: str | None) -> bytes:
    if rng is None:
        return data
    a, _, b = rng.removeprefix("bytes=").partition("-")
    if not a:
        return data[-int(b) :]
    return data[int(a) : int(b) + 1] if b else data[int(a) :]


async def _metric(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


async def _serve(tmp_path: Path, sendfile: bool) -> tuple[KVTestServer, str]:
    cfg = server_config(tmp_path / f"data-{sendfile}", sendfile=str(sendfile).lower())
    server = KVTestServer(make_app(cfg, MasterKey(os.urandom(32))), host="127.0.0.1", port=free_port())
    await server.start_server()
    return server, f"http://127.0.0.1:{server.port}"


async def _put_all(session: aiohttp.ClientSession, base: str, policy: str, blocks: dict[str, bytes]) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with session.post(base + "/v1/admin/tenants", json={"name": "t", "policy": policy}, headers=admin) as r:
        h = {"Authorization": f"Bearer {(await r.json())['token']}"}
    for k, v in blocks.items():
        async with session.put(f"{base}/v1/blocks/{k}", data=io.BytesIO(v), headers=h) as r:
            assert r.status == 201
    return h


@pytest.mark.parametrize("policy", ["direct", "sealed"])
async def test_every_range_shape_matches_the_mapping_path(tmp_path: Path, policy: str) -> None:
    blocks = {
        "kv": kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 5 * FRAME + 321],
        "big": random.Random(1).randbytes(BIG),
    }
    answers: dict[bool, list[tuple[int, bytes]]] = {}
    async with aiohttp.ClientSession() as session:
        for sendfile in (True, False):
            server, base = await _serve(tmp_path, sendfile)
            try:
                h = await _put_all(session, base, policy, blocks)
                got = []
                for k, v in blocks.items():
                    for rng in _ranges(len(v)):
                        headers = h if rng is None else {**h, "Range": rng}
                        async with session.get(f"{base}/v1/blocks/{k}", headers=headers) as r:
                            body = await r.read()
                            assert r.status == (200 if rng is None else 206), (rng, r.status)
                            assert body == _expect(v, rng), (k, rng)
                            got.append((r.status, body))
                answers[sendfile] = got
                sent = await _metric(session, base, "kvstore_http_sendfile_bytes_total")
                # Direct blocks went out by sendfile (all, or what the socket took) only where it is on.
                assert (sent > 0) == (sendfile and policy == "direct"), sent
            finally:
                await server.close()
    assert answers[True] == answers[False]


async def test_a_corrupt_frame_is_an_error_and_never_sent(api: Api) -> None:
    data = random.Random(2).randbytes(4 * FRAME)
    h = api.auth(await api.tenant("d", "direct"))
    async with api.session.put(api.url("/v1/blocks/x"), data=data, headers=h) as r:
        assert r.status == 201
    seg = next((api.config.store.data_dir / "segments" / "d").glob("*.seg"))
    at = seg.read_bytes().index(data[:64]) + 2 * FRAME + 10  # inside frame 2
    with seg.open("r+b") as f:
        f.seek(at)
        f.write(bytes([data[2 * FRAME + 10] ^ 0xFF]))
    for rng in (None, f"bytes={2 * FRAME}-{2 * FRAME + 99}", f"bytes={FRAME}-{3 * FRAME}"):
        headers = h if rng is None else {**h, "Range": rng}
        async with api.session.get(api.url("/v1/blocks/x"), headers=headers) as r:
            assert r.status == 500 and (await r.json())["error"]["code"] == "corruption", rng
    # Frames the damage does not touch still serve (each range verifies only its frames).
    async with api.session.get(api.url("/v1/blocks/x"), headers={**h, "Range": f"bytes=0-{FRAME - 1}"}) as r:
        assert r.status == 206 and await r.read() == data[:FRAME]


async def test_the_daemon_sends_with_sendfile_on_tcp_and_unix_sockets(daemon: Daemon, tmp_path: Path) -> None:
    sock = str(tmp_path / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}"]
    daemon.start()
    data = random.Random(3).randbytes(BIG)
    async with aiohttp.ClientSession() as tcp:
        h = await _put_all(tcp, daemon.base, "direct", {"b": data})
        async with tcp.get(daemon.base + "/v1/blocks/b", headers=h) as r:
            assert await r.read() == data
        after_tcp = await _metric(tcp, daemon.base, "kvstore_http_sendfile_bytes_total")
        assert after_tcp > 0
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as local:
            rng = {**h, "Range": "bytes=100000-2200000"}
            async with local.get("http://localhost/v1/blocks/b", headers=rng) as r:
                assert r.status == 206 and await r.read() == data[100_000:2_200_001]
        assert await _metric(tcp, daemon.base, "kvstore_http_sendfile_bytes_total") > after_tcp
    assert daemon.stop() == 0
