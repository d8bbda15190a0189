"""The fast lane (kvstore/transport/http/fastlane.py): GET and HEAD of a
block answered from the connection's bytes give exactly the route's answers
(status, headers, body) for every request shape, count what the route
counts, keep requests in order on a connection (pipelined, split into single
bytes, mixed with requests aiohttp answers), leave whatever it cannot frame
to aiohttp's defences, and never send bytes of a block compacted or
deleted under the reads."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvstore.daemon.app import make_app
from kvstore.engine.crypto import MasterKey
from kvstore.transport.http.appkeys import METRICS, STORE
from kvstore.transport.http.connection import KVServer
from kvstore.transport.http.qos import ADMISSION
from tests.http.conftest import ADMIN, Api, Daemon, KVTestServer, daemon_env, free_port, server_config
from tests.http.rawhttp import Conn, Reply
from tests.polling import until

BLOCK = 300_000  # several 64 KiB frames
SHAPES: list[tuple[str, dict[str, str]]] = [
    ("GET", {}),
    ("HEAD", {}),
    ("GET", {"Range": "bytes=0-9"}),
    ("GET", {"Range": "bytes=65530-65545"}),  # across a frame boundary
    ("GET", {"Range": "bytes=-100"}),
    ("GET", {"Range": "bytes=299990-"}),
    ("GET", {"Range": "bytes=0-1,5-6"}),  # several specs: the whole block
    ("GET", {"Range": "bytes=400000-"}),  # 416
    ("GET", {"Range": "bites=0-1"}),  # malformed: ignored
    ("HEAD", {"Range": "bytes=0-9"}),
    ("GET", {"If-None-Match": "ETAG"}),
    ("HEAD", {"If-None-Match": "ETAG"}),
    ("GET", {"If-None-Match": 'W/"ETAG", "other"'}),
    ("GET", {"If-None-Match": '"nope"'}),
    ("GET", {"If-None-Match": "*"}),
    ("GET", {"Connection": "close"}),
]


class Lane:
    def __init__(self, api: Api) -> None:
        self.api = api
        assert api.server is not None and api.server.runner is not None
        server = self.server = api.server
        kv = server.runner.server
        assert isinstance(kv, KVServer)
        self.kv = kv

    def on(self, on: bool) -> None:
        """The lane for connections opened from now on."""
        self.kv.fast_lane = on

    def answered(self, method: str = "GET") -> float:
        return self.server.app[METRICS].counter("kvstore_http_fast_lane_total", method=method)


@pytest.fixture
def lane(api: Api) -> Lane:
    return Lane(api)


async def _raw(api: Api, method: str, path: str, headers: dict[str, str]) -> Reply:
    conn = await Conn.open("127.0.0.1", int(api.base.rsplit(":", 1)[1]))
    try:
        return await conn.request(method, path, headers)
    finally:
        await conn.close()


async def _put(api: Api, token: str, key: str, data: bytes) -> None:
    async with api.session.put(api.url(f"/v1/blocks/{key}"), data=io.BytesIO(data), headers=api.auth(token)) as r:
        assert r.status in (200, 201), await r.text()


def _comparable(r: Reply) -> tuple[int, dict[str, str], bytes]:
    return r.status, {k: v for k, v in r.headers.items() if k != "date"}, r.body


async def test_every_request_shape_gets_the_routes_answer(lane: Lane) -> None:
    api = lane.api
    tokens = {p: await api.tenant(p, p) for p in ("direct", "sealed")}
    data = os.urandom(BLOCK)
    for token in tokens.values():
        await _put(api, token, "k", data)
    etags = {p: (await _raw(api, "HEAD", "/v1/blocks/k", api.auth(t))).headers["etag"] for p, t in tokens.items()}
    cases = [
        (p, m, "/v1/blocks/k", {**api.auth(t), **{k: v.replace("ETAG", etags[p].strip('"')) for k, v in h.items()}})
        for p, t in tokens.items()
        for m, h in SHAPES
    ]
    cases += [
        ("direct", "GET", "/v1/blocks/missing", api.auth(tokens["direct"])),
        ("direct", "HEAD", "/v1/blocks/missing", api.auth(tokens["direct"])),
        ("direct", "GET", "/v1/blocks/k", api.auth("kvs_unknown")),
        ("direct", "GET", "/v1/blocks/k", {}),
        ("direct", "GET", "/v1/blocks/k", {"Authorization": "Basic abc"}),
        ("direct", "GET", "/v1/blocks/%6B", api.auth(tokens["direct"])),  # percent-encoded: aiohttp's
        ("direct", "GET", "/v1/blocks/k?x=1", api.auth(tokens["direct"])),
        ("direct", "GET", "/v1/blocks/bad%20key", api.auth(tokens["direct"])),
        ("direct", "GET", "/v1/blocks/k", {**api.auth(tokens["direct"]), "Expect": "100-continue"}),
        ("sealed", "GET", "/v1/blocks/k", api.auth(tokens["direct"])),  # another tenant's token: 404
    ]
    before = lane.answered("GET") + lane.answered("HEAD")
    answers: dict[bool, list[tuple[int, dict[str, str], bytes]]] = {}
    for on in (False, True):
        lane.on(on)
        answers[on] = [_comparable(await _raw(api, m, path, h)) for _, m, path, h in cases]
    for case, off, on in zip(cases, answers[False], answers[True], strict=True):
        assert off == on, case
    assert {a[0] for a in answers[True]} >= {200, 206, 304, 404, 401, 416}
    served = lane.answered("GET") + lane.answered("HEAD") - before
    # Direct: every shape but 416 and Connection: close; sealed: HEAD and 304s only.
    assert served >= 18, served
    whole = [
        a
        for (p, m, _, h), a in zip(cases, answers[True], strict=True)
        if p == "direct" and m == "GET" and not h.keys() - {"Authorization"}
    ]
    assert whole and all(a[2] == data for a in whole if a[0] == 200)


async def test_requests_stay_in_order_pipelined_split_and_mixed(lane: Lane) -> None:
    api = lane.api
    lane.on(True)
    token = await api.tenant("direct", "direct")
    blocks = {f"b{i}": os.urandom(BLOCK + i) for i in range(3)}
    for k, v in blocks.items():
        await _put(api, token, k, v)
    auth = f"Authorization: Bearer {token}\r\n"
    put_body = os.urandom(70_000)
    lookup = b'{"keys": ["b0", "b1", "nope"]}'
    raw = (
        f"GET /v1/blocks/b0 HTTP/1.1\r\nHost: x\r\n{auth}\r\n"
        f"PUT /v1/blocks/new HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(put_body)}\r\n\r\n"
    ).encode() + put_body
    raw += f"GET /v1/blocks/b1 HTTP/1.1\r\nHost: x\r\n{auth}Range: bytes=10-19\r\n\r\n".encode()
    raw += f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(lookup)}\r\n\r\n".encode() + lookup
    raw += f"GET /v1/blocks/new HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
    raw += f"HEAD /v1/blocks/b2 HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
    raw += f"GET /v1/blocks/b2 HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode()
    port = int(api.base.rsplit(":", 1)[1])
    for split in (None, 1, 7, 4096):
        conn = await Conn.open("127.0.0.1", port)
        try:
            if split is None:
                await conn.send(raw)
            else:
                for i in range(0, len(raw), split):
                    await conn.send(raw[i : i + split])
            r = [await conn.read_reply() for _ in range(5)]
            r += [await conn.read_reply(head=True), await conn.read_reply()]
        finally:
            await conn.close()
        assert [x.status for x in r[:4]] == [200, 201 if split is None else 200, 206, 200], split
        assert r[0].body == blocks["b0"] and r[2].body == blocks["b1"][10:20]
        assert r[3].json()["present"] == [True, True, False]
        assert r[4].status == 200 and r[4].body == put_body
        assert r[5].status == 200 and r[5].headers["content-length"] == str(BLOCK + 2) and not r[5].body
        assert r[6].status == 200 and r[6].body == blocks["b2"]
    assert lane.answered("GET") >= 4  # at least the first of each connection (the rest as aiohttp is busy)


async def test_what_it_cannot_frame_is_aiohttps_to_refuse(lane: Lane) -> None:
    api = lane.api
    lane.on(True)
    token = await api.tenant("direct", "direct")
    await _put(api, token, "k", b"x" * 1000)
    port = int(api.base.rsplit(":", 1)[1])
    cases = [
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64), 400),  # TLS to a plain port
        (b"GET /v1/blocks/k HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /v1/blocks/k HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /v1/blocks/k HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
        (b"GET /v1/blocks/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 401),
        (b"GET /v1/blocks/k HTTP/1.1\r\nHost: x\r\n Folded: yes\r\n\r\n", 400),
    ]
    for raw, status in cases:
        conn = await Conn.open("127.0.0.1", port)
        try:
            await conn.send(raw)
            r = await conn.read_reply()
        finally:
            await conn.close()
        assert r.status == status, (raw[:40], r.status, r.body)
        assert r.code is not None, r.body
    assert lane.answered("GET") == 0


async def test_a_client_that_stops_reading_gets_everything_in_order_later(lane: Lane) -> None:
    api = lane.api
    lane.on(True)
    token = await api.tenant("direct", "direct")
    blocks = [os.urandom(2 << 20) for _ in range(3)]
    for i, b in enumerate(blocks):
        await _put(api, token, f"b{i}", b)
    port = int(api.base.rsplit(":", 1)[1])
    conn = await Conn.open("127.0.0.1", port)
    try:
        n = 24
        raw = b"".join(
            f"GET /v1/blocks/b{i % 3} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
            for i in range(n)
        )
        await conn.send(raw)
        # Kept: the point of the test is a client that stops reading for a while
        # (the transport pauses writing; the rest waits for aiohttp).
        await asyncio.sleep(0.5)
        for i in range(n):
            r = await conn.read_reply(timeout=30)
            assert r.status == 200 and r.body == blocks[i % 3], i
    finally:
        await conn.close()


async def test_reads_under_compaction_and_deletes_never_send_wrong_bytes(lane: Lane) -> None:
    api = lane.api
    lane.on(True)
    token = await api.tenant("direct", "direct")
    store = lane.server.app[STORE]
    data = {f"k{i}": os.urandom(100_000 + i) for i in range(30)}
    for k, v in data.items():
        await _put(api, token, k, v)
    stop = asyncio.Event()
    seen = {"ok": 0, "missing": 0}

    async def reader() -> None:
        port = int(api.base.rsplit(":", 1)[1])
        conn = await Conn.open("127.0.0.1", port)
        try:
            i = 0
            while not stop.is_set():
                k = f"k{i % 30}"
                i += 1
                r = await conn.request("GET", f"/v1/blocks/{k}", api.auth(token))
                if r.status == 404:
                    seen["missing"] += 1
                    continue
                assert r.status == 200 and r.body == data[k], k
                seen["ok"] += 1
        finally:
            await conn.close()

    readers = [asyncio.create_task(reader()) for _ in range(3)]
    for i in range(0, 30, 2):
        async with api.session.delete(api.url(f"/v1/blocks/k{i}"), headers=api.auth(token)) as r:
            assert r.status == 204
        if i % 6 == 0:
            await store.compact("direct")
    await store.compact("direct")
    done = seen["ok"] + seen["missing"]
    await until("30 reads after the last compaction", lambda: seen["ok"] + seen["missing"] >= done + 30)
    stop.set()
    await asyncio.gather(*readers)
    assert seen["ok"] > 30 and seen["missing"] > 0, seen
    assert lane.answered("GET") > 30
    async with api.session.get(api.url("/metrics"), headers=api.auth(ADMIN)) as r:
        assert "kvstore_http_fast_lane_total" in await r.text()


async def test_the_daemon_answers_on_the_lane_under_uvloop(tmp_path: Path) -> None:
    """server.py (uvloop, whose transports are not asyncio.Transport
    subclasses) takes the lane, and ``fast_lane = false`` turns it off."""
    from tests.http.conftest import Daemon, daemon_env
    from tests.http.test_daemon import _ready

    for on in ("true", "false"):
        (tmp_path / on).mkdir()
        env = {**daemon_env(tmp_path / on), "KVSTORE_FAST_LANE": on}
        daemon = Daemon(tmp_path / on / "data", free_port(), env, log_dir=tmp_path / on)
        daemon.start()
        try:
            async with aiohttp.ClientSession() as session:
                api = Api(daemon.base, session, server_config(tmp_path))
                await _ready(daemon.base, session)
                token = await api.tenant("direct", "direct")
                data = os.urandom(1 << 20)
                await _put(api, token, "k", data)
                conn = await Conn.open("127.0.0.1", daemon.port)
                try:
                    for i in range(20):
                        r = await conn.request(
                            "GET", "/v1/blocks/k", {**api.auth(token), "Range": f"bytes={i}-{i + 9999}"}
                        )
                        assert r.status == 206 and r.body == data[i : i + 10_000]
                finally:
                    await conn.close()
                async with session.get(daemon.base + "/metrics") as r:
                    text = await r.text()
            answered = [ln for ln in text.splitlines() if ln.startswith('kvstore_http_fast_lane_total{method="GET"}')]
            puts = [ln for ln in text.splitlines() if ln.startswith('kvstore_http_fast_lane_total{method="PUT"}')]
            if on == "true":
                assert answered and float(answered[0].split()[-1]) == 20, answered
                assert puts and float(puts[0].split()[-1]) == 1, puts  # its body read by uvloop into aligned memory
            else:
                assert not answered and not puts, (answered, puts)
            assert 'kvstore_http_requests_total{method="GET",route="/v1/blocks/{key}",status="206"} 20' in text
        finally:
            assert daemon.stop() == 0


async def test_lookups_get_the_routes_answer(lane: Lane) -> None:
    api = lane.api
    token = await api.tenant("direct", "direct")
    for k in ("a", "b", "d"):
        await _put(api, token, k, b"v" * 100)
    port = int(api.base.rsplit(":", 1)[1])
    ok = b'{"keys": ["a", "b", "c", "d"]}'
    bodies: list[tuple[bytes, dict[str, str]]] = [
        (ok, {}),
        (ok, {"Content-Type": "application/json"}),
        (b'{"keys": ["a"], "tokens_per_block": 16}', {}),
        (b'{"keys": ["a"], "tokens_per_block": 0}', {}),
        (b'{"keys": ["a"], "tokens_per_block": true}', {}),
        (b'{"keys": "a"}', {}),
        (b'{"keys": ["a", "bad key"]}', {}),
        (b'{"keys": [' + b",".join(b'"k%d"' % i for i in range(300)) + b"]}", {}),
        (b'{"keys": ["a"]', {}),
        (b"[1]", {}),
        (b'{"keys": ["a"], "lease_s": 5}', {}),
        (ok, {"Content-Type": "application/json; charset=latin-1"}),
        (ok, {"Authorization": "Bearer kvs_nobody"}),
    ]
    answers: dict[bool, list[tuple[int, dict[str, str], bytes]]] = {}
    for on in (False, True):
        lane.on(on)
        answers[on] = []
        for body, extra in bodies:
            conn = await Conn.open("127.0.0.1", port)
            try:
                r = await conn.request("POST", "/v1/lookup", {**api.auth(token), **extra}, body)
            finally:
                await conn.close()
            answers[on].append(_comparable(r))
    for (body, extra), off, on in zip(bodies, answers[False], answers[True], strict=True):
        if b"lease_s" in body:  # a new lease id each time
            assert off[0] == on[0] == 200 and off[1] == on[1], (body, extra)
            continue
        assert off == on, (body[:60], extra)
    assert answers[True][0][0] == 200 and b'"prefix": 2' in answers[True][0][2]
    assert {a[0] for a in answers[True]} >= {200, 400, 401}
    assert lane.answered("POST") == 3  # the three valid ones


async def test_the_client_librarys_lookups_and_gets_take_the_lane(lane: Lane) -> None:
    """What the engine adapters call: the vLLM connector's lookups
    (``lookup_detail``, no lease) and block reads go through the lane."""
    from kvstore_client import AsyncClient

    api = lane.api
    lane.on(True)
    token = await api.tenant("direct", "direct")
    data = {f"k{i}": os.urandom(50_000 + i) for i in range(4)}
    for k, v in data.items():
        await _put(api, token, k, v)
    async with AsyncClient(api.base, token) as client:
        assert await client.lookup_detail(["k0", "k1", "nope", "k3"], 16) == [True, True, False, True]
        assert await client.lookup(["k0", "k1", "k2"]) == 3
        for k, v in data.items():
            assert await client.get(k) == v
    assert lane.answered("POST") == 2
    # The first get asks GET /v1/records/k0 (client-side decode, which a direct
    # tenant answers with the route's refusal), then /v1/blocks/ for every key.
    assert lane.answered("GET") == 3


async def test_a_scrub_makes_every_worker_check_a_damaged_segment_again(tmp_path: Path) -> None:
    """Two workers have verified a direct block's frames (the verified-frames
    cache); the file is damaged on disk; a scrub reports it, and from then on
    both workers refuse the block (500 corruption) instead of sending it."""
    from tests.http.rawhttp import worker_connections

    async with _two_workers(tmp_path) as (daemon, session, api, token):
        data = os.urandom(300_000)
        await _put(api, token, "k", data)
        # Kept: the reader worker's first sweep (SWEEP_INTERVAL_S after it
        # starts) forgets verified frames, and no answer shows that it has
        # run; once it has, only a scrub makes the next.
        await asyncio.sleep(SWEEP_WAIT_S)
        conns = await worker_connections("127.0.0.1", daemon.port)
        try:
            for role, conn in conns.items():
                r = await conn.request("GET", "/v1/blocks/k", api.auth(token))
                assert r.status == 200 and r.body == data, role
            seg = next((tmp_path / "data" / "segments" / "direct").glob("*.seg"))
            raw = seg.read_bytes()
            at = raw.index(data[:64]) + 100
            with seg.open("r+b") as f:
                f.seek(at)
                f.write(bytes([raw[at] ^ 0xFF]))
            for role, conn in conns.items():  # verified before the damage: served as it is on disk
                r = await conn.request("GET", "/v1/blocks/k", {**api.auth(token), "Range": "bytes=0-999"})
                assert r.status == 206 and r.body != data[:1000], role
            async with session.post(daemon.base + "/v1/admin/verify", headers=api.auth(ADMIN)) as r:
                report = await r.json()
            assert r.status == 200 and report["errors"], report
            for role, conn in conns.items():  # a reader worker looks again when the epoch moves

                async def refused(conn: Conn = conn) -> bool:
                    r = await conn.request("GET", "/v1/blocks/k", {**api.auth(token), "Range": "bytes=0-999"})
                    assert r.status in (206, 500), (r.status, r.body[:200])  # served as on disk until it looks
                    return r.status == 500 and r.code == "corruption"

                await until(f"the {role} refuses the damaged block", refused)
        finally:
            for conn in conns.values():
                await conn.close()


SWEEP_WAIT_S = 2.5  # SWEEP_INTERVAL_S (1 s) and some


# PUT /v1/blocks/{key} on the lane: the body received into aligned memory
# (a buffered protocol), then stored.


def _put_comparable(r: Reply) -> tuple[int, dict[str, str], bytes]:
    """A PUT's answer without what differs from store to store (the date, the ETag's record id)."""
    headers = {k: ("ETAG" if k == "etag" else v) for k, v in r.headers.items() if k != "date"}
    return r.status, headers, r.body


async def test_puts_get_the_routes_answer(lane: Lane) -> None:
    """Every shape of PUT gets the same answer with the lane on and off: a
    new key, an existing one, a Kvstore-Block-Meta, errors the lane leaves to
    the route (bad token, meta, key, length, Expect) and an error of the
    store that the lane answers itself (507 quota_exceeded); what was stored
    reads back."""
    api = lane.api
    port = int(api.base.rsplit(":", 1)[1])
    data = os.urandom(BLOCK)
    ident = {"block_hash": 7, "parent_block_hash": 6, "token_ids": [1, 2, 3], "block_size": 16}
    meta = base64.urlsafe_b64encode(json.dumps(ident).encode()).decode().rstrip("=")
    answers: dict[bool, list[tuple[int, dict[str, str], bytes]]] = {}
    counted: dict[bool, float] = {}
    tokens: dict[tuple[bool, str], str] = {}
    for on in (False, True):
        lane.on(on)
        for p in ("direct", "sealed"):
            tokens[on, p] = await api.tenant(f"{p}-{int(on)}", p)
        small = await api.tenant(f"small-{int(on)}", "direct", quota_bytes=100_000)
        cases: list[tuple[str, dict[str, str], bytes]] = []
        for p in ("direct", "sealed"):
            auth = api.auth(tokens[on, p])
            cases += [
                ("/v1/blocks/k", auth, data),
                ("/v1/blocks/k", auth, data[:1000]),  # exists: 200, nothing written
                ("/v1/blocks/m", {**auth, "Kvstore-Block-Meta": meta}, data[:5000]),
                ("/v1/blocks/m2", {**auth, "Kvstore-Block-Meta": "not base64!"}, b"x"),
                ("/v1/blocks/s3m~x", auth, b"x"),  # a reserved key
                ("/v1/blocks/e", {**auth, "Expect": "100-continue"}, b"x"),
            ]
        cases += [
            ("/v1/blocks/k", api.auth("kvs_unknown"), b"x"),
            ("/v1/blocks/big", api.auth(small), data),  # larger than the whole quota: the store's 507
            ("/v1/blocks/big", api.auth(tokens[on, "direct"]), bytes(4 << 20) + b"x"),  # 413 before the body
        ]
        before = lane.answered("PUT")
        answers[on] = []
        for path, headers, body in cases:
            conn = await Conn.open("127.0.0.1", port)
            try:
                status, got, text = _put_comparable(await conn.request("PUT", path, headers, body))
                answers[on].append((status, got, text.replace(f"-{int(on)}'".encode(), b"'")))  # tenant names
            finally:
                await conn.close()
        counted[on] = lane.answered("PUT") - before
    for off, on_ in zip(answers[False], answers[True], strict=True):
        assert off == on_
    assert [a[0] for a in answers[True]] == [201, 200, 201, 400, 400, 201] * 2 + [401, 507, 413]
    assert counted[False] == 0 and counted[True] == 7, counted  # 2 x (new, exists, meta) and the 507
    for (on, p), token in tokens.items():
        async with api.session.get(api.url("/v1/blocks/k"), headers=api.auth(token)) as r:
            assert r.status == 200 and await r.read() == data, (on, p)
        async with api.session.get(api.url("/v1/blocks/m"), headers=api.auth(token)) as r:
            assert r.status == 200 and await r.read() == data[:5000], (on, p)


async def test_a_put_split_and_pipelined_is_stored_and_answered_in_order(lane: Lane) -> None:
    """A PUT's headers and body split anywhere, with requests pipelined after
    it: the body is taken to its last byte and no further, what follows is
    answered after the put, in order."""
    api = lane.api
    lane.on(True)
    token = await api.tenant("direct", "direct")
    auth = f"Authorization: Bearer {token}\r\n"
    port = int(api.base.rsplit(":", 1)[1])
    for n, split in enumerate((None, 1, 7, 4096, 65_539)):
        body = os.urandom(BLOCK + n)
        key = f"p{n}"
        raw = f"PUT /v1/blocks/{key} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(body)}\r\n\r\n".encode()
        raw += body
        raw += f"GET /v1/blocks/{key} HTTP/1.1\r\nHost: x\r\n{auth}Range: bytes=5-14\r\n\r\n".encode()
        lookup = f'{{"keys": ["{key}", "nope"]}}'.encode()
        raw += f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(lookup)}\r\n\r\n".encode()
        raw += lookup
        before = lane.answered("PUT")
        conn = await Conn.open("127.0.0.1", port)
        try:
            if split is None:
                await conn.send(raw)
            else:
                head = raw.index(b"\r\n\r\n") + 4
                # Single bytes for the headers and the body's start (1 and 7
                # would take long over a whole block), then pieces of `split`.
                cut = head + 100 if split < 100 else 0
                for i in range(0, cut):
                    await conn.send(raw[i : i + 1])
                for i in range(cut, len(raw), split if split >= 100 else 4093):
                    await conn.send(raw[i : i + (split if split >= 100 else 4093)])
            r = [await conn.read_reply() for _ in range(3)]
        finally:
            await conn.close()
        assert r[0].status == 201 and r[0].json() == {"key": key, "size": len(body), "created": True}, split
        assert r[1].status == 206 and r[1].body == body[5:15], split
        assert r[2].status == 200 and r[2].json()["present"] == [True, False], split
        assert lane.answered("PUT") == before + 1, split
        async with api.session.get(api.url(f"/v1/blocks/{key}"), headers=api.auth(token)) as g:
            assert await g.read() == body


def _budget(api: Api) -> tuple[int, int]:
    """(body bytes held against max_buffered_body_bytes, requests in flight) of the server."""
    assert api.server is not None
    app = api.server.app
    admission = app[ADMISSION]
    return admission.budget.used, admission.inflight


@pytest.fixture
async def slow_api(tmp_path: Path) -> AsyncIterator[Api]:
    """A server whose bodies have 1 s to arrive (request_timeout_s)."""
    cfg = server_config(tmp_path / "data", request_timeout_s="1")
    server = KVTestServer(make_app(cfg, MasterKey(os.urandom(32))), host="127.0.0.1", port=free_port())
    await server.start_server()
    async with aiohttp.ClientSession() as session:
        yield Api(f"http://127.0.0.1:{server.port}", session, cfg, server=server)
    await server.close()


async def test_a_put_body_that_stalls_ends_short_or_is_dropped_gives_everything_back(slow_api: Api) -> None:
    """A body that stops arriving gets the route's 408 after request_timeout_s
    and its connection closes; one ended by a half-close gets 400 naming the
    bytes that came; one whose client goes away gets nothing. Each time the
    body budget and the in-flight slot come back and nothing is stored. A
    body that was whole before the half-close is stored and answered."""
    api = slow_api
    token = await api.tenant("direct", "direct")
    port = int(api.base.rsplit(":", 1)[1])
    assert api.server is not None and api.server.runner is not None
    kv = api.server.runner.server
    assert isinstance(kv, KVServer)
    length = 1 << 20

    def head(key: str, n: int = length) -> bytes:
        auth = f"Authorization: Bearer {token}\r\n"
        return f"PUT /v1/blocks/{key} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {n}\r\n\r\n".encode()

    answers: dict[bool, list[tuple[int, str, str]]] = {}
    for on in (False, True):
        kv.fast_lane = on
        answers[on] = []
        conn = await Conn.open("127.0.0.1", port)  # stalls
        try:
            await conn.send(head(f"stall{int(on)}") + b"x" * 1000)
            await until("the stalled body's budget and slot taken", lambda: _budget(api) == (length, 1))
            r = await conn.read_reply(timeout=10)
            answers[on].append((r.status, r.json()["error"]["code"], r.json()["error"]["message"]))
            assert await conn.reader.read() == b""  # closed after the answer
        finally:
            await conn.close()
        conn = await Conn.open("127.0.0.1", port)  # ends short
        try:
            await conn.send(head(f"short{int(on)}") + b"x" * 1000)
            conn.writer.write_eof()
            r = await conn.read_reply(timeout=10)
            answers[on].append((r.status, r.json()["error"]["code"], r.json()["error"]["message"]))
        finally:
            await conn.close()
        conn = await Conn.open("127.0.0.1", port)  # goes away
        await conn.send(head(f"gone{int(on)}") + b"x" * 1000)
        await until("the dropped body's budget and slot taken", lambda: _budget(api) == (length, 1))
        await conn.close()
        body = os.urandom(300_000)
        conn = await Conn.open("127.0.0.1", port)  # whole, then a half-close
        try:
            await conn.send(head(f"whole{int(on)}", len(body)) + body)
            conn.writer.write_eof()
            r = await conn.read_reply(timeout=10)
            assert r.status == 201, r.body
            assert await conn.reader.read() == b""
        finally:
            await conn.close()
        await until(f"the body budget and slots back (lane {on})", lambda: _budget(api) == (0, 0))
        for key, status in (("stall", 404), ("short", 404), ("gone", 404), ("whole", 200)):
            async with api.session.get(api.url(f"/v1/blocks/{key}{int(on)}"), headers=api.auth(token)) as g:
                assert g.status == status, (on, key)
                if status == 200:
                    assert await g.read() == body
    assert answers[False] == answers[True]
    assert [a[:2] for a in answers[True]] == [(408, "request_timeout"), (400, "invalid_input")]
    assert "1000 of 1048576" in answers[True][1][2]


async def test_puts_on_two_workers_are_stored_once_and_read_back_everywhere(tmp_path: Path) -> None:
    """With two workers, a PUT on the reader is relayed to the writer (whose
    lane takes it from the relay's connection), a PUT on the writer is taken
    by its lane; both read back on both workers, and a second PUT of a key
    answers 200 wherever it lands."""
    from tests.http.rawhttp import worker_connections

    async with _two_workers(tmp_path) as (daemon, session, api, token):
        blocks = {f"{role}{i}": os.urandom(200_000 + i) for role in ("writer", "reader") for i in range(4)}
        conns = await worker_connections("127.0.0.1", daemon.port)
        try:
            for key, data in blocks.items():
                r = await conns[key[:6]].request("PUT", f"/v1/blocks/{key}", api.auth(token), data)
                assert r.status == 201, (key, r.body)
            for role, conn in conns.items():
                r = await conn.request("PUT", "/v1/blocks/reader0", api.auth(token), b"other bytes")
                assert r.status == 200 and r.json()["created"] is False, role
                for key, data in blocks.items():
                    r = await conn.request("GET", f"/v1/blocks/{key}", api.auth(token))
                    assert r.status == 200 and r.body == data, (role, key)
        finally:
            for conn in conns.values():
                await conn.close()

        async def lane_puts() -> bool:  # a worker's /metrics merges the other's figures a moment later
            async with session.get(daemon.base + "/metrics") as r:
                text = await r.text()
            puts = [ln for ln in text.splitlines() if ln.startswith('kvstore_http_fast_lane_total{method="PUT"}')]
            return bool(puts) and float(puts[0].split()[-1]) >= 10

        await until("the writer's lane counted every PUT", lane_puts)


@contextlib.asynccontextmanager
async def _two_workers(tmp_path: Path) -> AsyncIterator[tuple[Daemon, aiohttp.ClientSession, Api, str]]:
    """A --workers 2 daemon, ready, a session, and a direct tenant's token."""
    from tests.http.test_daemon import _ready

    daemon = Daemon(tmp_path / "data", free_port(), daemon_env(tmp_path), extra=["--workers", "2"], log_dir=tmp_path)
    daemon.start()
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(daemon.base, session)
            api = Api(daemon.base, session, server_config(tmp_path))
            yield daemon, session, api, await api.tenant("direct", "direct")
    finally:
        assert daemon.stop() == 0


async def test_each_tenants_requests_and_bytes_are_counted_the_same_on_and_off_the_lane(lane: Lane) -> None:
    """kvstore_tenant_requests_total and kvstore_tenant_bytes_total count a
    tenant's requests and block bytes alike whether the lane or the route
    answers (PUT, GET, ranged GET, HEAD, lookup, batch get), and never
    another tenant's."""
    api = lane.api
    port = int(api.base.rsplit(":", 1)[1])
    data = os.urandom(BLOCK)
    for on in (False, True):
        lane.on(on)
        token = await api.tenant(f"t-{int(on)}", "direct")
        conn = await Conn.open("127.0.0.1", port)
        try:
            assert (await conn.request("PUT", "/v1/blocks/k", api.auth(token), data)).status == 201
            assert (await conn.request("GET", "/v1/blocks/k", api.auth(token))).status == 200
            r = await conn.request("GET", "/v1/blocks/k", {**api.auth(token), "Range": "bytes=10-109"})
            assert r.status == 206
            assert (await conn.request("HEAD", "/v1/blocks/k", api.auth(token))).status == 200
            assert (await conn.request("POST", "/v1/lookup", api.auth(token), b'{"keys": ["k"]}')).status == 200
            r = await conn.request("POST", "/v1/batch/get", api.auth(token), b'{"keys": ["k"]}')
            assert r.status == 200
        finally:
            await conn.close()
    metrics = lane.server.app[METRICS]
    for on in (False, True):
        t = f"t-{int(on)}"
        assert metrics.counter("kvstore_tenant_requests_total", tenant=t) == 6, t
        assert metrics.counter("kvstore_tenant_bytes_total", tenant=t, direction="in") == BLOCK, t
        assert metrics.counter("kvstore_tenant_bytes_total", tenant=t, direction="out") == 2 * BLOCK + 100, t
    assert lane.answered("PUT") >= 1 and lane.answered("POST") >= 1


async def test_a_read_the_lane_hands_over_is_looked_up_and_counted_once(
    lane: Lane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: a read the lane resolves and cannot finish (a sealed block
    not in the decoded cache, a miss) goes on at the route from what the lane
    found: one authentication, one index lookup, one hit or miss counted per
    GET, on and off the lane alike. (The store's own methods, wrapped to
    count their calls.)"""
    api = lane.api
    port = int(api.base.rsplit(":", 1)[1])
    metrics = lane.server.app[METRICS]
    store = lane.server.app[STORE]
    calls = {"authenticate": 0, "resolve": 0}
    for name in calls:
        real = getattr(store, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(store, name, counted)
    data = os.urandom(BLOCK)
    counts: dict[bool, tuple[float, ...]] = {}
    for on in (False, True):
        lane.on(on)
        token = await api.tenant(f"s-{int(on)}", "sealed")
        await _put(api, token, "k", data)
        hits = metrics.counter("kvstore_lookups_total", result="hit")
        misses = metrics.counter("kvstore_lookups_total", result="miss")
        before = dict(calls)
        conn = await Conn.open("127.0.0.1", port)
        try:
            for _ in range(3):  # the first misses the decoded cache: the route decodes it
                r = await conn.request("GET", "/v1/blocks/k", api.auth(token))
                assert (r.status, r.body == data) == (200, True)
            assert (await conn.request("GET", "/v1/blocks/absent", api.auth(token))).status == 404
        finally:
            await conn.close()
        counts[on] = (
            metrics.counter("kvstore_lookups_total", result="hit") - hits,
            metrics.counter("kvstore_lookups_total", result="miss") - misses,
            calls["authenticate"] - before["authenticate"],
            calls["resolve"] - before["resolve"],
        )
    assert counts[True] == counts[False] == (3, 1, 4, 4), counts
