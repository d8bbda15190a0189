"""Write plans over the unix socket: the daemon reserves room in the tenant's
open segment and passes its descriptor; the client writes the block's bytes
itself (O_DIRECT where the filesystem takes it) and commits their checksums;
the daemon reads them back, checks, syncs and indexes them. Whatever the
client does with the descriptor, a block is served only as it was checked;
an abandoned, expired or disconnected plan leaves only dead space."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import tempfile
from pathlib import Path

import aiohttp
import pytest
import xxhash
from kvstore_client import AsyncClient
from kvstore_client.errors import ServerError
from kvstore_client.plans import PlanConnection
from kvstore_client.write_plans import frame_checksums, write_block

from ..conftest import kv_sample
from .conftest import ADMIN, Daemon
from .openapi import Spec

BLOCK = 200_000  # five to a 1 MiB segment


async def _admin(s: aiohttp.ClientSession, base: str, method: str, path: str, body: object = None) -> object:
    async with s.request(method, base + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status < 300, await r.text()
        return await r.json() if r.content_type == "application/json" else None


async def _tenant(base: str, name: str, policy: str = "direct") -> str:
    async with aiohttp.ClientSession() as s:
        doc = await _admin(s, base, "POST", "/v1/admin/tenants", {"name": name, "policy": policy})
    assert isinstance(doc, dict)
    return str(doc["token"])


async def _get(base: str, token: str, key: str) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{base}/v1/blocks/{key}", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        return r.status, await r.read()


def _blocks(prefix: str, n: int) -> dict[str, bytes]:
    return {f"{prefix}{i}": random.Random(f"{prefix}{i}").randbytes(BLOCK + i * 4099) for i in range(n)}


def _start(daemon: Daemon, sock_dir: Path, workers: int = 1, *extra: str) -> str:
    sock = str(sock_dir / "kv.sock")
    daemon.extra = ["--listen", f"unix:{sock}", "--unix-socket-mode", "0666", "--compact-interval-s", "0"]
    daemon.extra += ["--workers", str(workers), *extra]
    daemon.start()
    return sock


def _write_all(conn: PlanConnection, blocks: dict[str, bytes], direct: bool = True) -> tuple[str, dict[str, object]]:
    """Plan, write every block, and commit: (plan id, commit answer by key)."""
    doc, fds = conn.plan_writes([{"key": k, "size": len(v)} for k, v in blocks.items()])
    try:
        commits = []
        for b in doc["blocks"]:
            if b.get("exists"):
                continue
            data = blocks[b["key"]]
            write_block(fds[b["file"]], memoryview(data), b["offset"], b["length"], direct and _direct(fds[b["file"]]))
            commits.append({"key": b["key"], "xxh3": frame_checksums(memoryview(data), b["frame_size"])})
    finally:
        for fd in fds:
            os.close(fd)
    answer = conn.commit_writes(doc["plan"], commits) if commits else {"blocks": []}
    return doc["plan"], {r["key"]: r for r in answer["blocks"]}


def _direct(fd: int) -> bool:
    from kvstore_client.write_plans import _set_direct

    return _set_direct(fd)


@pytest.mark.parametrize("workers", [1, 2])
async def test_planned_writes_are_read_back_over_every_path(daemon: Daemon, sock_dir: Path, workers: int) -> None:
    sock = _start(daemon, sock_dir, workers)
    token = await _tenant(daemon.base, "d")
    blocks = _blocks("w", 9) | {"kv": kv_sample("gemma3-270m.bf16.layers8-9.bin")[: 3 * BLOCK]}
    conn = PlanConnection(sock, token)
    try:
        _, done = _write_all(conn, blocks)
        assert {k: r["status"] for k, r in done.items()} == dict.fromkeys(blocks, 201)
        # Written again: the first write wins; nothing to write.
        doc, fds = conn.plan_writes([{"key": "w0", "size": len(blocks["w0"])}])
        assert fds == [] and doc["blocks"] == [{"key": "w0", "status": 200, "exists": True, "etag": done["w0"]["etag"]}]
        # The answer is what docs/openapi.yaml describes.
        doc, fds = conn.plan_writes([{"key": "spec", "size": 10}])
        for fd in fds:
            os.close(fd)
        assert Spec.load().problems("POST", "/v1/write-plan", 200, "application/json", json.dumps(doc).encode()) == []
        conn.abandon_writes(doc["plan"])
    finally:
        conn.close()
    for k, v in blocks.items():  # GET over TCP
        assert await _get(daemon.base, token, k) == (200, v)
    async with AsyncClient(f"unix:{sock}", token) as c:  # read plans, and the client's own put_many
        for k, v in blocks.items():
            buf = bytearray(len(v))
            assert await c.get_into(k, buf) == len(v) and buf == v
        more = _blocks("m", 4)
        assert await c.put_many(list(more.items())) == [True] * 4
        assert c.stats["plan_writes"] == 4
        for k, v in more.items():
            assert await c.get(k) == v
    status, _ = await _get(daemon.base, token, "spec")
    assert status == 404  # abandoned: never stored
    daemon.stop()
    daemon.start()  # recovery steps over the pads
    for k, v in (blocks | more).items():
        assert await _get(daemon.base, token, k) == (200, v)


async def test_bytes_that_do_not_match_are_refused_and_never_served(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "d")
    data = random.Random(1).randbytes(3 * BLOCK)
    conn = PlanConnection(sock, token)
    try:
        doc, fds = conn.plan_writes([{"key": "a", "size": len(data)}, {"key": "b", "size": len(data)}])
        a, b = doc["blocks"]
        write_block(fds[a["file"]], memoryview(data), a["offset"], a["length"], False)
        # b: written wrong (one byte flipped), then claimed with the right checksums.
        bad = bytearray(data)
        bad[12345] ^= 1
        write_block(fds[b["file"]], memoryview(bad), b["offset"], b["length"], False)
        for fd in fds:
            os.close(fd)
        sums = frame_checksums(memoryview(data), a["frame_size"])
        answer = conn.commit_writes(doc["plan"], [{"key": "a", "xxh3": sums}, {"key": "b", "xxh3": sums}])
        by = {r["key"]: r for r in answer["blocks"]}
        assert by["a"]["status"] == 201
        assert by["b"]["status"] == 422 and by["b"]["error"]["code"] == "checksum_mismatch"
        with pytest.raises(ServerError) as e:  # the plan ended with its commit
            conn.commit_writes(doc["plan"], [{"key": "b", "xxh3": sums}])
        assert e.value.status == 404 and e.value.code == "write_plan_not_found"
        # Checksums of the wrong count, keys not in the plan: 400 naming the field.
        doc, fds = conn.plan_writes([{"key": "c", "size": len(data)}])
        for fd in fds:
            os.close(fd)
        with pytest.raises(ServerError, match="frames are planned") as e:
            conn.commit_writes(doc["plan"], [{"key": "c", "xxh3": sums[:1]}])
        assert e.value.status == 400
        with pytest.raises(ServerError, match="not in write plan") as e:
            conn.commit_writes(doc["plan"], [{"key": "zz", "xxh3": sums}])
        assert e.value.status == 400
        # Never written at all: the zeros there do not match.
        answer = conn.commit_writes(doc["plan"], [{"key": "c", "xxh3": sums}])
        assert answer["blocks"][0]["status"] == 422
    finally:
        conn.close()
    assert await _get(daemon.base, token, "a") == (200, data)
    for k in ("b", "c"):
        assert (await _get(daemon.base, token, k))[0] == 404


async def test_damage_after_the_commit_is_corruption_never_bytes(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "d")
    data = random.Random(2).randbytes(BLOCK)
    conn = PlanConnection(sock, token)
    try:
        doc, fds = conn.plan_writes([{"key": "a", "size": len(data)}])
        b = doc["blocks"][0]
        write_block(fds[0], memoryview(data), b["offset"], b["length"], False)
        conn.commit_writes(doc["plan"], [{"key": "a", "xxh3": frame_checksums(memoryview(data), b["frame_size"])}])
        os.pwrite(fds[0], b"\xff" * 10, b["offset"] + 100)  # the descriptor outlives the plan
        os.close(fds[0])
    finally:
        conn.close()
    status, body = await _get(daemon.base, token, "a")
    assert status == 500 and b"corrupt" in body.lower()


async def test_bad_requests_get_precise_errors(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "d")
    sealed = await _tenant(daemon.base, "s", "sealed")
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            daemon.base + "/v1/write-plan",
            json={"blocks": [{"key": "a", "size": 1}]},
            headers={"Authorization": f"Bearer {token}"},
        ) as r,
    ):
        assert r.status == 400 and (await r.json())["error"]["code"] == "unix_socket_required"
    conn = PlanConnection(sock, token)
    try:
        for body, field in [
            ([], "blocks"),
            ([{"key": "a"}], "size"),
            ([{"key": "a", "size": 0}], "size"),
            ([{"key": "a", "size": 1}, {"key": "a", "size": 1}], "twice"),
            ([{"key": "bad/key", "size": 1}], "key"),
            ([{"key": "a", "size": 1, "zz": 1}], "zz"),
        ]:
            with pytest.raises(ServerError, match=field) as e:
                conn.plan_writes(body)
            assert e.value.status == 400, body
        with pytest.raises(ServerError) as e:
            conn.plan_writes([{"key": "a", "size": 1 << 40}])
        assert e.value.status == 413
    finally:
        conn.close()
    sconn = PlanConnection(sock, sealed)
    try:
        with pytest.raises(ServerError) as e:
            sconn.plan_writes([{"key": "a", "size": 10}])
        assert e.value.status == 409 and e.value.code == "not_plannable"
    finally:
        sconn.close()
    # The client library seals a sealed tenant's blocks itself (encode="auto"), or
    # with encode="server" sends them over HTTP, where the daemon seals them.
    async with AsyncClient(f"unix:{sock}", sealed, encode="server") as c:
        assert await c.put_many([("x", b"abc" * 1000)]) == [True]
        assert c.stats["plan_writes"] == 0 and await c.get("x") == b"abc" * 1000
    async with AsyncClient(f"unix:{sock}", sealed) as c:
        assert await c.put_many([("y", b"abc" * 1000)]) == [True]
        assert c.stats["plan_writes"] == 1 and await c.get("y") == b"abc" * 1000


async def test_plans_end_with_their_lease_or_their_connection(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "d")
    data = random.Random(3).randbytes(BLOCK)
    conn = PlanConnection(sock, token)
    try:
        doc, fds = conn.plan_writes([{"key": "a", "size": len(data)}], lease_s=0.5)
        for fd in fds:
            os.close(fd)
        await asyncio.sleep(2.5)
        with pytest.raises(ServerError) as e:
            conn.commit_writes(doc["plan"], [{"key": "a", "xxh3": ["0" * 16]}])
        assert e.value.code == "write_plan_not_found"
        # The key is free again: a put of it goes through at once.
        async with AsyncClient(daemon.base, token) as c:
            assert await asyncio.wait_for(c.put("a", data), 10)
        # A connection that closes ends its plans: their keys are free at once.
        doc, fds = conn.plan_writes([{"key": "b", "size": len(data)}], lease_s=600)
        for fd in fds:
            os.close(fd)
    finally:
        conn.close()
    async with AsyncClient(daemon.base, token) as c:
        assert await asyncio.wait_for(c.put("b", data), 10)
        assert await c.get("b") == data


async def test_a_kill_at_any_step_leaves_nothing_half_written(daemon: Daemon, sock_dir: Path) -> None:
    """kill -9 after the reservation, after the client's writes, and between
    commits: every acknowledged block intact after restart, nothing
    unacknowledged served, and the dead space is compacted away."""
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "d")
    blocks = _blocks("k", 6)
    conn = PlanConnection(sock, token)
    _, done = _write_all(conn, dict(list(blocks.items())[:2]))  # acknowledged
    assert all(r["status"] == 201 for r in done.values())
    _reserved, fds = conn.plan_writes([{"key": "k2", "size": len(blocks["k2"])}])  # reserved only
    written, wfds = conn.plan_writes([{"key": "k3", "size": len(blocks["k3"])}])  # written, not committed
    b = written["blocks"][0]
    write_block(wfds[0], memoryview(blocks["k3"]), b["offset"], b["length"], False)
    for fd in (*fds, *wfds):
        os.close(fd)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    conn.close()
    daemon.start()
    for k in ("k0", "k1"):
        assert await _get(daemon.base, token, k) == (200, blocks[k])
    for k in ("k2", "k3"):
        assert (await _get(daemon.base, token, k))[0] == 404
    conn = PlanConnection(sock, token)
    try:
        _, done = _write_all(conn, {k: blocks[k] for k in ("k2", "k3", "k4")})
        assert all(r["status"] == 201 for r in done.values())
    finally:
        conn.close()
    async with aiohttp.ClientSession() as s:
        await _admin(s, daemon.base, "POST", "/v1/admin/flush")
        await _admin(s, daemon.base, "POST", "/v1/admin/compact")
        doc = await _admin(s, daemon.base, "POST", "/v1/admin/verify")
    assert isinstance(doc, dict) and not doc.get("errors"), doc
    for k in ("k0", "k1", "k2", "k3", "k4"):
        assert await _get(daemon.base, token, k) == (200, blocks[k])


def test_write_block_pads_to_its_length(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"\xee" * 20000, 0)
        data = bytes(range(256)) * 20
        write_block(fd, memoryview(data), 4096, 8192, False)
        got = os.pread(fd, 20000, 0)
        assert got[4096 : 4096 + len(data)] == data and got[4096 + len(data) : 12288] == bytes(12288 - 4096 - len(data))
        assert got[:4096] == b"\xee" * 4096 and got[12288:] == b"\xee" * (20000 - 12288)
    finally:
        os.close(fd)
    sums = frame_checksums(memoryview(data), 1000)
    assert len(sums) == 6 and sums[0] == f"{xxhash.xxh3_64_intdigest(data[:1000]):016x}"


def _sealed_plan(conn: PlanConnection, blocks: dict[str, bytes]) -> tuple[dict[str, object], list[int]]:
    doc, fds = conn.plan_writes([{"key": k, "size": len(v)} for k, v in blocks.items()], encode="client")
    return doc, fds


def _sealed(b: dict[str, object], data: bytes) -> tuple[bytearray, list[dict[str, object]]]:
    """``data`` sealed as the plan entry ``b`` says: its stored frames back to back, and their entries."""
    from kvstore_client.write_plans import seal_block

    stored, frames = seal_block(memoryview(data), b, None)
    return bytearray(b"".join(stored)), frames


def _write_raw(fd: int, b: dict[str, object], raw: bytes | bytearray) -> None:
    write_block(fd, memoryview(raw), int(b["offset"]), -(-len(raw) // 4096) * 4096, False)  # type: ignore[call-overload]


def _xxh3(data: bytes | bytearray) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


@pytest.mark.parametrize("workers", [1, 2])
async def test_client_sealed_records_are_checked_then_served(daemon: Daemon, sock_dir: Path, workers: int) -> None:
    """A sealed tenant's blocks encoded and sealed by the client: read back
    by GET (the daemon opens them), by read plans (the client opens them)
    and after a restart; the plan never carries the tenant's key, only each
    record's own; the room the compressed frames did not need is a pad."""
    sock = _start(daemon, sock_dir, workers)
    token = await _tenant(daemon.base, "s", "sealed")
    kv = kv_sample("gemma3-270m.bf16.layers8-9.bin")
    blocks = {"bf16": kv[: 3 * BLOCK], "noise": random.Random(5).randbytes(BLOCK), "tiny": b"x" * 100}
    async with AsyncClient(f"unix:{sock}", token, encode="client") as c:
        assert await c.put_many(list(blocks.items())) == [True] * 3
        assert c.stats["plan_writes"] == 3
        for k, v in blocks.items():
            buf = bytearray(len(v))
            assert await c.get_into(k, buf) == len(v) and buf == v
    for k, v in blocks.items():
        assert await _get(daemon.base, token, k) == (200, v)
    async with aiohttp.ClientSession() as s:
        async with s.head(f"{daemon.base}/v1/blocks/bf16", headers={"Authorization": f"Bearer {token}"}) as r:
            assert r.status == 200
        doc = await _admin(s, daemon.base, "POST", "/v1/admin/verify")
        assert isinstance(doc, dict) and not doc.get("errors"), doc
    # The plan answer: each record's own key, and what docs/openapi.yaml describes.
    conn = PlanConnection(sock, token)
    try:
        doc, fds = _sealed_plan(conn, {"spec": b"y" * 5000})
        for fd in fds:
            os.close(fd)
        rec = doc["blocks"][0]["record"]  # type: ignore[index]
        assert set(rec) == {"tenant", "record_id", "key_version", "frame_count", "frame_key", "compression", "level"}
        assert Spec.load().problems("POST", "/v1/write-plan", 200, "application/json", json.dumps(doc).encode()) == []
        conn.abandon_writes(str(doc["plan"]))
        # A sealed tenant without encode=client: 409, PUT instead.
        with pytest.raises(ServerError) as e:
            conn.plan_writes([{"key": "z", "size": 10}])
        assert e.value.status == 409 and e.value.code == "not_plannable"
    finally:
        conn.close()
    daemon.stop()
    daemon.start()
    for k, v in blocks.items():
        assert await _get(daemon.base, token, k) == (200, v)


async def test_forged_truncated_replayed_and_misbound_records_are_refused(daemon: Daemon, sock_dir: Path) -> None:
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "s", "sealed")
    other = await _tenant(daemon.base, "t", "sealed")
    data = kv_sample("gemma3-270m.bf16.layers8-9.bin")[:BLOCK]
    conn, oconn = PlanConnection(sock, token), PlanConnection(sock, other)
    try:
        # An earlier plan's record of the same key, committed: its bytes are what a replay sends.
        doc, fds = _sealed_plan(conn, {"old": data})
        b = doc["blocks"][0]  # type: ignore[index]
        old_stored, old_frames = _sealed(b, data)
        _write_raw(fds[0], b, old_stored)
        done = conn.commit_writes(str(doc["plan"]), [{"key": "old", "frames": old_frames}])
        assert done["blocks"][0]["status"] == 201
        for fd in fds:
            os.close(fd)

        def attempt(how: str) -> dict[str, object]:
            c = oconn if how == "cross-tenant" else conn
            doc, fds = _sealed_plan(c, {"k": data})
            b = doc["blocks"][0]  # type: ignore[index]
            try:
                if how == "replayed":  # another record's bytes (another id, another key): its tags fail here
                    raw, frames = old_stored, old_frames
                elif how == "cross-tenant":  # sealed for tenant s's plan, written into tenant t's
                    sdoc, sfds = _sealed_plan(conn, {"k": data})
                    raw, frames = _sealed(sdoc["blocks"][0], data)  # type: ignore[index]
                    for fd in sfds:
                        os.close(fd)
                    conn.abandon_writes(str(sdoc["plan"]))
                else:
                    raw, frames = _sealed(b, data)
                    n0 = int(frames[0]["len"])  # type: ignore[call-overload]
                    if how == "forged":  # one ciphertext byte changed, its checksum made to match
                        raw[100] ^= 1
                        frames[0]["xxh3"] = _xxh3(raw[:n0])
                    elif how == "truncated":  # the last frame cut short by its tag
                        last = len(raw) - int(frames[-1]["len"])  # type: ignore[call-overload]
                        frames[-1]["len"] = int(frames[-1]["len"]) - 16  # type: ignore[call-overload]
                        frames[-1]["xxh3"] = _xxh3(raw[last : last + int(frames[-1]["len"])])  # type: ignore[call-overload]
                _write_raw(fds[0], b, raw)
            finally:
                for fd in fds:
                    os.close(fd)
            answer = c.commit_writes(str(doc["plan"]), [{"key": "k", "frames": frames}])
            return dict(answer["blocks"][0])

        for how in ("forged", "truncated", "replayed", "cross-tenant"):
            r = attempt(how)
            assert r["status"] == 422 and r["error"]["code"] == "record_rejected", (how, r)  # type: ignore[index]
        # A frame table that does not fit the plan: 400 before anything is read.
        doc, fds = _sealed_plan(conn, {"k": data})
        for fd in fds:
            os.close(fd)
        n = doc["blocks"][0]["record"]["frame_count"]  # type: ignore[index]
        bad = [{"len": 10**9, "codec": "zstd", "xxh3": "0" * 16}] * n
        with pytest.raises(ServerError, match="does not fit its plan") as e:
            conn.commit_writes(str(doc["plan"]), [{"key": "k", "frames": bad}])
        assert e.value.status == 400
        with pytest.raises(ServerError, match="length, codec and xxh3") as e:
            conn.commit_writes(str(doc["plan"]), [{"key": "k", "xxh3": ["0" * 16] * n}])
    finally:
        conn.close()
        oconn.close()
    for t in (token, other):
        assert (await _get(daemon.base, t, "k"))[0] == 404  # nothing refused was ever stored
    assert await _get(daemon.base, token, "old") == (200, data)


@pytest.mark.parametrize("workers", [1, 2])
async def test_write_plans_race_flush_compaction_deletes_and_tenant_deletion(
    daemon: Daemon, sock_dir: Path, workers: int
) -> None:
    """Clients storing through write plans (direct, and sealed with client
    encode) while the admin flushes, compacts and deletes; then a tenant is
    deleted under a client's feet. Every block acknowledged and not deleted
    reads back as written; the store verifies clean."""
    sock = _start(daemon, sock_dir, workers)
    tokens = {"d": await _tenant(daemon.base, "d"), "s": await _tenant(daemon.base, "s", "sealed")}
    gone = await _tenant(daemon.base, "gone")
    stored: dict[tuple[str, str], bytes] = {}
    deleted: set[tuple[str, str]] = set()

    async def writer(t: str) -> None:
        async with AsyncClient(f"unix:{sock}", tokens[t], timeout=30) as c:
            for r in range(6):
                batch = {f"{t}{r}-{i}": random.Random(f"{t}{r}{i}").randbytes(120_000) for i in range(4)}
                assert await c.put_many(list(batch.items())) == [True] * 4
                assert c.stats["plan_writes"] == 4 * (r + 1)
                stored.update({(t, k): v for k, v in batch.items()})

    async def admin() -> None:
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                await _admin(s, daemon.base, "POST", "/v1/admin/flush")
                await _admin(s, daemon.base, "POST", "/v1/admin/compact")
                for t, k in list(stored)[i::5]:
                    async with s.delete(
                        f"{daemon.base}/v1/blocks/{k}", headers={"Authorization": f"Bearer {tokens[t]}"}
                    ) as r:
                        if r.status == 204:
                            deleted.add((t, k))
                await asyncio.sleep(0.05)

    async def doomed() -> None:
        """A tenant deleted while its client stores: every answer is a
        success or a clean error, never a hang."""
        async with AsyncClient(f"unix:{sock}", gone, timeout=10, retries=0) as c:
            for r in range(4):
                await c.put_many([(f"g{r}", b"x" * 50_000)])
                if r == 1:
                    async with aiohttp.ClientSession() as s:
                        await _admin(s, daemon.base, "DELETE", "/v1/admin/tenants/gone")

    await asyncio.wait_for(asyncio.gather(writer("d"), writer("s"), admin(), doomed()), 120)
    for (t, k), v in stored.items():
        status, body = await _get(daemon.base, tokens[t], k)
        if (t, k) in deleted:
            assert status == 404, k
        else:
            assert (status, body) == (200, v), k
    async with aiohttp.ClientSession() as s:
        await _admin(s, daemon.base, "POST", "/v1/admin/flush")
        await _admin(s, daemon.base, "POST", "/v1/admin/compact")
        doc = await _admin(s, daemon.base, "POST", "/v1/admin/verify")
    assert isinstance(doc, dict) and not doc.get("errors"), doc


@pytest.mark.parametrize("workers", [1, 2])
async def test_sealed_records_sealed_by_the_client_go_up_over_tcp(daemon: Daemon, workers: int) -> None:
    """Over TCP on loopback (where a record's key may go) a sealed tenant's
    blocks are sealed by the client and uploaded into a write plan; a direct
    tenant's are not planned there (batch PUT)."""
    daemon.extra = ["--workers", str(workers), "--compact-interval-s", "0"]
    daemon.start()
    sealed, direct = await _tenant(daemon.base, "s", "sealed"), await _tenant(daemon.base, "d")
    kv = kv_sample("gemma3-270m.bf16.layers8-9.bin")
    blocks = {"a": kv[:BLOCK], "b": kv[BLOCK : 3 * BLOCK], "c": random.Random(9).randbytes(5000)}
    async with AsyncClient(daemon.base, sealed) as c:  # encode="auto": uploads only where asked for
        assert await c.put_many([("auto", b"q" * 5000)]) == [True]
        assert c.stats["plan_writes"] == 0
    async with AsyncClient(daemon.base, sealed, encode="client") as c:
        assert await c.put_many(list(blocks.items())) == [True] * 3
        assert c.stats["plan_writes"] == 3
        assert await c.put_many([("a", b"again")]) == [True]  # first write wins
    for k, v in blocks.items():
        assert await _get(daemon.base, sealed, k) == (200, v)
    async with AsyncClient(daemon.base, direct, encode="client") as c:
        assert await c.put_many([("x", b"y" * 9000), ("z", b"w" * 100)]) == [True, True]
        assert c.stats["plan_writes"] == 0
        assert await c.get("x") == b"y" * 9000
    async with aiohttp.ClientSession(daemon.base) as s:

        async def post(token: str, path: str, body: object) -> tuple[int, dict[str, object]]:
            async with s.post(path, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
                return r.status, await r.json()

        status, err = await post(sealed, "/v1/write-plan", {"blocks": [{"key": "k", "size": 10}]})
        assert (status, err["error"]["code"]) == (400, "unix_socket_required")  # type: ignore[index]
        status, err = await post(direct, "/v1/write-plan", {"blocks": [{"key": "k", "size": 10}], "encode": "client"})
        assert (status, err["error"]["code"]) == (400, "unix_socket_required")  # type: ignore[index]
        data = kv[:BLOCK]
        status, doc = await post(
            sealed, "/v1/write-plan", {"blocks": [{"key": "k", "size": len(data)}], "encode": "client"}
        )
        assert status == 200 and doc["files"] == [] and "file" not in doc["blocks"][0]  # type: ignore[index]
        assert Spec.load().problems("POST", "/v1/write-plan", 200, "application/json", json.dumps(doc).encode()) == []
        b = doc["blocks"][0]  # type: ignore[index]
        raw, frames = _sealed(b, data)
        auth = {"Authorization": f"Bearer {sealed}"}
        plan = doc["plan"]
        async with s.put(f"/v1/write-plan/{plan}/blocks/zz", data=bytes(raw), headers=auth) as r:
            assert r.status == 400  # not in the plan
        async with s.put(f"/v1/write-plan/{plan}/blocks/k", data=bytes(raw) + bytes(b["length"]), headers=auth) as r:
            assert r.status == 413  # more than the room reserved
        raw[7] ^= 1  # forged: the checksum made to match, the tag cannot be
        frames[0]["xxh3"] = _xxh3(raw[: int(frames[0]["len"])])  # type: ignore[call-overload]
        async with s.put(f"/v1/write-plan/{plan}/blocks/k", data=bytes(raw), headers=auth) as r:
            assert r.status == 204
        status, done = await post(sealed, f"/v1/write-plan/{plan}", {"blocks": [{"key": "k", "frames": frames}]})
        assert status == 200 and done["blocks"][0]["error"]["code"] == "record_rejected"  # type: ignore[index]
    assert (await _get(daemon.base, sealed, "k"))[0] == 404


async def test_a_commit_without_checksums_takes_them_from_what_landed(daemon: Daemon, sock_dir: Path) -> None:
    """What a GPU source commits (``"xxh3": null``: no host copy to sum):
    the daemon sums what it reads back; the block is served and checked on
    every read like any other. (The kvikio write itself needs a GPU.)"""
    sock = _start(daemon, sock_dir)
    token = await _tenant(daemon.base, "d")
    data = random.Random(11).randbytes(3 * BLOCK + 5)
    conn = PlanConnection(sock, token)
    try:
        doc, fds = conn.plan_writes([{"key": "g", "size": len(data)}])
        b = doc["blocks"][0]
        write_block(fds[0], memoryview(data), b["offset"], b["length"], False)
        for fd in fds:
            os.close(fd)
        answer = conn.commit_writes(doc["plan"], [{"key": "g", "xxh3": None}])
        assert answer["blocks"][0]["status"] == 201
    finally:
        conn.close()
    assert await _get(daemon.base, token, "g") == (200, data)
    async with AsyncClient(f"unix:{sock}", token) as c:  # read plans check the daemon's sums
        buf = bytearray(len(data))
        assert await c.get_into("g", buf) == len(data) and buf == data


def test_a_gpu_buffer_is_written_with_kvikio() -> None:
    pytest.importorskip("kvikio", reason="kvikio (GPUDirect Storage) is not installed: no GPU on this machine")
    cupy = pytest.importorskip("cupy", reason="cupy is not installed: no GPU on this machine")
    from kvstore_client.write_plans import _write_gpu

    data = cupy.arange(1 << 20, dtype=cupy.uint8)
    with tempfile.NamedTemporaryFile() as f:
        fd = os.open(f.name, os.O_WRONLY)
        try:
            _write_gpu(fd, data, 4096, data.nbytes)
        finally:
            os.close(fd)
        assert f.read()[4096:] == data.get().tobytes()
