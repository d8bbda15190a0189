"""Residency events from a real daemon: Server-Sent Events (order, tenant
isolation, resumption, the gap, relayed by a reader worker) and ZMQ in
vLLM's wire format (both encodings, gapless batch numbers, replay)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from kvstore_client.wire import batchframe

from kvstore.events.model import key_hash

from .conftest import ADMIN, Daemon, free_port
from .test_read_plans import _admin, _tenant


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _put(s: aiohttp.ClientSession, base: str, token: str, key: str, data: bytes = b"v" * 100) -> None:
    async with s.put(f"{base}/v1/blocks/{key}", data=data, headers=_auth(token)) as r:
        assert r.status == 201, await r.text()


async def _delete(s: aiohttp.ClientSession, base: str, token: str, key: str) -> None:
    async with s.delete(f"{base}/v1/blocks/{key}", headers=_auth(token)) as r:
        assert r.status == 204


class Sse:
    """An open ``GET /v1/events`` stream."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp

    async def next(self, timeout: float = 10) -> tuple[str, str, Any]:
        """(id, event, data) of the next message, comments skipped."""
        fields: dict[str, str] = {}
        while True:
            line = (await asyncio.wait_for(self.resp.content.readline(), timeout)).decode()
            assert line, "the stream ended"
            line = line.rstrip("\n")
            if not line:
                if fields:
                    return fields.get("id", ""), fields.get("event", "message"), json.loads(fields["data"])
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value


async def _sse(s: aiohttp.ClientSession, base: str, token: str, **headers: str) -> Sse:
    resp = await s.get(f"{base}/v1/events", headers=_auth(token) | headers, timeout=aiohttp.ClientTimeout(total=None))
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return Sse(resp)


@pytest.mark.parametrize("workers", [1, 2])
async def test_sse_order_isolation_resume_and_gap(daemon: Daemon, workers: int) -> None:
    daemon.env |= {"KVSTORE_EVENTS_BACKLOG": "20"}
    daemon.extra = ["--workers", str(workers)]
    daemon.start()
    base = daemon.base
    async with aiohttp.ClientSession() as s:
        ta = await _tenant(s, base, "a", "sealed")
        tb = await _tenant(s, base, "b", "direct")
        mine, everyone = await _sse(s, base, ta), await _sse(s, base, ADMIN)
        await _put(s, base, ta, "k1", b"x" * 1234)
        await _put(s, base, tb, "k1")
        await _delete(s, base, ta, "k1")
        # The tenant sees its own events only, in order; the admin sees every tenant's.
        first = await mine.next()
        assert first[1] == "stored"
        assert first[2]["tenant"] == "a" and first[2]["cause"] == "put" and first[2]["tier"] == "local"
        assert first[2]["blocks"] == [
            {
                "key": "k1",
                "size": 1234,
                "block_hash": key_hash("k1"),
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 0,
                "lora_id": None,
                "lora_name": None,
                "extra_keys": None,
            }
        ]
        second = await mine.next()
        assert second[1] == "removed" and second[2]["cause"] == "deleted" and int(second[0]) > int(first[0])
        seen = [await everyone.next() for _ in range(3)]
        assert [(e, d["tenant"]) for _, e, d in seen] == [("stored", "a"), ("stored", "b"), ("removed", "a")]
        ids = [int(i) for i, _, _ in seen]
        assert ids == list(range(ids[0], ids[0] + 3))  # the node's numbers, without gaps
        # Resumption: from after the first event of tenant a.
        again = await _sse(s, base, ta, **{"Last-Event-ID": first[0]})
        assert (await again.next())[:2] == (second[0], "removed")
        # A resumption from numbers no longer kept starts with a gap.
        for i in range(30):
            await _put(s, base, ta, f"m{i}")
        late = await _sse(s, base, ta, **{"Last-Event-ID": "0"})
        sid, kind, gap = await late.next()
        assert kind == "gap" and gap["first"] == 1 and gap["last"] >= 10 and sid == str(gap["last"])
        following = await late.next()
        assert following[1] == "stored" and int(following[0]) == gap["last"] + 1
        # Bad input names the field.
        async with s.get(f"{base}/v1/events?since=-3", headers=_auth(ta)) as r:
            assert r.status == 400 and "since" in (await r.json())["error"]["message"]
        async with s.get(f"{base}/v1/events", headers={"Last-Event-ID": "x", **_auth(ta)}) as r:
            assert r.status == 400 and "Last-Event-ID" in (await r.json())["error"]["message"]
        async with s.get(f"{base}/v1/events", headers=_auth("nope")) as r:
            assert r.status == 401
        for stream in (mine, everyone, again, late):
            stream.resp.close()


async def _joined(sub: zmq.asyncio.Socket, s: aiohttp.ClientSession, base: str, token: str) -> None:
    """A subscriber joins a PUB socket asynchronously: put warm-up blocks
    (warm0, warm1, ...) until it gets a batch (left for the caller to read)."""
    for n in range(50):
        await _put(s, base, token, f"warm{n}")
        if await sub.poll(200):
            return
    raise AssertionError("the subscriber never connected")


def _decode(payload: bytes, encoding: str) -> tuple[float, list[Any], Any]:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and rank is None
    if encoding == "map":
        return ts, events, rank
    # The array encoding: [tag, fields...] as vLLM before 0.10 sent them; as maps for the checks.
    names = {
        "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
        "BlockRemoved": ["block_hashes", "medium"],
        "AllBlocksCleared": [],
    }
    return ts, [{"type": e[0], **dict(zip(names[e[0]], e[1:], strict=True))} for e in events], rank


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_zmq_batches_in_vllms_format_with_replay(daemon: Daemon, encoding: str) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    daemon.env |= {
        "KVSTORE_EVENTS_ZMQ": pub,
        "KVSTORE_EVENTS_ZMQ_REPLAY": replay,
        "KVSTORE_EVENTS_ENCODING": encoding,
        "KVSTORE_EVENTS_MEDIUM_LOCAL": "SSD",
    }
    daemon.start()
    base = daemon.base
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        async with aiohttp.ClientSession() as s:
            ta = await _tenant(s, base, "za", "direct")
            tb = await _tenant(s, base, "zb", "sealed")
            await _joined(sub, s, base, ta)
            got = [await sub.recv_multipart()]
            await _put(s, base, tb, "k1")
            await _delete(s, base, ta, "warm0")
            await _admin(s, base, "DELETE", "/v1/admin/tenants/zb")
            events: list[tuple[bytes, int, dict[str, Any]]] = []
            while len(events) < 3:
                got.append(await asyncio.wait_for(sub.recv_multipart(), 10))
                topic, seq, payload = got[-1]
                _, evs, _ = _decode(payload, encoding)
                if topic == b"za" and evs[0]["type"] == "BlockStored" and evs[0]["block_hashes"] != [key_hash("warm0")]:
                    continue  # later warm-up puts
                events += [(topic, int.from_bytes(seq, "big"), e) for e in evs]
        seqs = [int.from_bytes(m[1], "big") for m in got]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # gapless batch numbers
        stored, removed, cleared = events[-3:]
        assert stored[0] == b"zb" and stored[2] == {
            "type": "BlockStored",
            "block_hashes": [key_hash("k1")],
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 0,
            "lora_id": None,
            "medium": "SSD",
            **({"lora_name": None} if encoding == "map" else {}),
        }
        assert removed[0] == b"za" and removed[2] == {
            "type": "BlockRemoved",
            "block_hashes": [key_hash("warm0")],
            "medium": "SSD",
        }
        assert cleared[0] == b"zb" and cleared[2] == {"type": "AllBlocksCleared"}
        # Replay from a number: exactly the batches published from there, then -1.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        start = seqs[1]
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
            assert frames[0] == b""
            if int.from_bytes(frames[2], "big", signed=True) == -1:
                break
            replayed.append(frames[1:])
        published = [m for m in got if int.from_bytes(m[1], "big") >= start]
        assert replayed[: len(published)] == published
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()


def test_replay_needs_the_pub_socket(daemon: Daemon) -> None:
    daemon.env |= {"KVSTORE_EVENTS_ZMQ_REPLAY": f"tcp://127.0.0.1:{free_port()}"}
    with pytest.raises(RuntimeError, match="events_zmq_replay needs events_zmq"):
        daemon.start(timeout=10)


def _meta_header(doc: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_engines_identity_from_a_put_is_in_its_events(daemon: Daemon, workers: int) -> None:
    daemon.extra = ["--workers", str(workers)]  # a reader relays the header to the writer
    daemon.start()
    base = daemon.base
    ident = {"block_hash": 123456789, "parent_block_hash": 42, "token_ids": [5, 6, 7, 8], "block_size": 4}
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "e", "sealed")
        stream = await _sse(s, base, token)
        headers = _auth(token) | {"Kvstore-Block-Meta": _meta_header(ident)}
        async with s.put(f"{base}/v1/blocks/b1", data=b"x" * 10, headers=headers) as r:
            assert r.status == 201
        _, kind, doc = await stream.next()
        assert kind == "stored" and doc["blocks"][0] | {} == {
            "key": "b1",
            "size": 10,
            **ident,
            "lora_id": None,
            "lora_name": None,
            "extra_keys": None,
        }
        # A batch in KVB2: each item its own identity; a bad one refuses that item only.
        metas = [json.dumps({"block_hash": 7}).encode(), b'{"block_hash": "x"}', None]
        body = batchframe.encode_put_stream([("c0", b"0"), ("c1", b"1"), ("c2", b"2")], metas)
        async with s.post(
            f"{base}/v1/batch/put", data=body, headers=_auth(token) | {"Content-Type": batchframe.CONTENT_TYPE}
        ) as r:
            results = (await r.json())["results"]
        assert [x["status"] for x in results] == [201, 400, 201]
        assert "item 1 (c1): meta" in results[1]["error"]["message"] and "block_hash" in results[1]["error"]["message"]
        got = [await stream.next() for _ in range(2)]
        assert [(d["blocks"][0]["key"], d["blocks"][0]["block_hash"]) for _, _, d in got] == [
            ("c0", 7),
            ("c2", key_hash("c2")),
        ]
        async with s.delete(f"{base}/v1/blocks/b1", headers=_auth(token)) as r:
            assert r.status == 204
        _, kind, doc = await stream.next()
        assert kind == "removed" and doc["blocks"][0]["block_hash"] == 123456789  # as it was stored
        # Bad headers name the header and the field; nothing is stored.
        for bad, field in (("%%%", "Kvstore-Block-Meta"), (_meta_header({"token_ids": [1]}), "block_hash")):
            async with s.put(
                f"{base}/v1/blocks/bad", data=b"x", headers=_auth(token) | {"Kvstore-Block-Meta": bad}
            ) as r:
                assert r.status == 400 and field in (await r.json())["error"]["message"]
        async with s.get(f"{base}/v1/blocks/bad", headers=_auth(token)) as r:
            assert r.status == 404
        stream.resp.close()


@pytest.mark.parametrize("transport", ["http", "nixl"])
async def test_the_client_sends_identities(daemon: Daemon, transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore_client import AsyncClient
    from kvstore_client.nixl import nixl_available

    if transport == "nixl":
        if not nixl_available():
            pytest.skip("NIXL is not installed (tests/run.sh installs it)")
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
        monkeypatch.setenv("UCX_TLS", "tcp")
        daemon.env |= {"KVSTORE_NIXL": "1", "KVSTORE_NIXL_DEVICES": "lo", "UCX_TLS": "tcp"}
    daemon.start()
    base = daemon.base
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, base, "cl", "direct")
        stream = await _sse(s, base, token)
        async with AsyncClient(base, token, strict=True, transport=transport) as c:  # type: ignore[arg-type]
            assert await c.put("one", b"1" * 10, {"block_hash": 11, "token_ids": [1, 2], "block_size": 2})
            metas = [{"block_hash": 21, "parent_block_hash": 11}, None]
            assert await c.put_many([("two", b"2" * 10), ("three", b"3" * 10)], metas) == [True, True]
            if transport == "nixl":
                assert c.stats["nixl_writes"] == 2 and c.stats["nixl_fallbacks"] == 0
        got: list[tuple[str, int]] = []
        while len(got) < 3:  # blocks stored together (a write plan's commit) may share one event
            _, _, d = await stream.next()
            got += [(b["key"], b["block_hash"]) for b in d["blocks"]]
        assert sorted(got) == sorted([("one", 11), ("two", 21), ("three", key_hash("three"))])
        stream.resp.close()


async def test_a_daemon_with_streams_open_stops_at_once(daemon: Daemon) -> None:
    """SIGTERM ends the event streams (and the ZMQ publisher) instead of
    waiting shutdown_timeout_s for them; it once spun the loop for ever."""
    daemon.env |= {"KVSTORE_EVENTS_ZMQ": f"tcp://127.0.0.1:{free_port()}"}
    daemon.start()
    async with aiohttp.ClientSession() as s:
        token = await _tenant(s, daemon.base, "stop", "direct")
        stream = await _sse(s, daemon.base, token)
        await _put(s, daemon.base, token, "k")
        assert (await stream.next())[1] == "stored"
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.to_thread(daemon.stop, timeout=10) == 0
        assert asyncio.get_running_loop().time() - t0 < 5
        rest = await asyncio.wait_for(stream.resp.content.read(), 5)  # the stream ended cleanly
        assert b"event:" not in rest


async def test_a_tenants_topic(daemon: Daemon) -> None:
    pub = f"tcp://127.0.0.1:{free_port()}"
    daemon.env |= {"KVSTORE_EVENTS_ZMQ": pub}
    daemon.start()
    base = daemon.base
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        async with aiohttp.ClientSession() as s:
            topic = "kv@pod-7@meta-llama/Llama-3.1-8B"
            doc = await _admin(s, base, "POST", "/v1/admin/tenants", {"name": "tp", "events_topic": topic})
            assert isinstance(doc, dict) and doc["events_topic"] == topic
            token = str(doc["token"])
            await _joined(sub, s, base, token)
            assert (await sub.recv_multipart())[0] == topic.encode()
            # Back to the tenant's name; bad values name the field.
            doc = await _admin(s, base, "PATCH", "/v1/admin/tenants/tp", {"events_topic": None})
            assert isinstance(doc, dict) and doc["events_topic"] is None
            while await sub.poll(300):
                await sub.recv_multipart()
            await _put(s, base, token, "after")
            assert (await asyncio.wait_for(sub.recv_multipart(), 10))[0] == b"tp"
            for bad in ("two words", 5, "x" * 300):
                async with s.patch(
                    f"{base}/v1/admin/tenants/tp", json={"events_topic": bad}, headers=_auth(ADMIN)
                ) as r:
                    assert r.status == 400 and "events_topic" in (await r.json())["error"]["message"]
            # The last events of a deleted tenant keep its topic.
            await _admin(s, base, "PATCH", "/v1/admin/tenants/tp", {"events_topic": "kv@pod-7@m"})
            await _admin(s, base, "DELETE", "/v1/admin/tenants/tp")
            topic_of_cleared = None
            while topic_of_cleared is None:
                frames = await asyncio.wait_for(sub.recv_multipart(), 10)
                if msgpack.unpackb(frames[2])[1][0]["type"] == "AllBlocksCleared":
                    topic_of_cleared = frames[0]
            assert topic_of_cleared == b"kv@pod-7@m"
    finally:
        sub.close(linger=0)
        ctx.term()
