"""Every call against a real daemon (server.py as a process)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import Daemon
from kvstore_client import AsyncClient, BufferTooSmall, Client, KVStoreClientError, ServerError, block_keys


async def test_every_call(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url, daemon.token, timeout=5) as c:
        block = os.urandom(200_000)
        assert await c.get("k1") is None
        assert await c.exists("k1") is False
        assert await c.put("k1", block) is True
        assert await c.put("k1", b"other") is True  # first write wins
        assert await c.get("k1") == block
        assert await c.exists("k1") is True
        assert await c.get_range("k1", 10, 1000) == block[10:1000]
        assert await c.get_range("k1", 199_990, 300_000) == block[199_990:]
        assert await c.get_range("k1", 300_000, 300_001) is None

        buf = bytearray(300_000)
        assert await c.get_into("k1", buf) == len(block)
        assert buf[: len(block)] == block
        assert await c.get_into("nope", buf) is None

        keys = [f"b{i}" for i in range(5)]
        assert await c.put_many([(k, k.encode() * 100) for k in keys]) == [True] * 5
        assert await c.get_many([*keys[:3], "missing", keys[4]]) == [
            *(k.encode() * 100 for k in keys[:3]),
            None,
            keys[4].encode() * 100,
        ]
        assert await c.lookup([*keys[:3], "missing", keys[4]]) == 3
        assert await c.lookup_detail(["missing", keys[0]]) == [False, True]
        assert await c.lookup([]) == 0
        assert await c.get_many([]) == []

        assert await c.delete("b0") is True
        assert await c.delete("b0") is False
        assert await c.lookup(keys) == 0
        assert c.stats["errors"] == 0
        assert c.stats["hits"] > 0 and c.stats["misses"] > 0


async def test_get_into_numpy(daemon: Daemon) -> None:
    kv = np.random.default_rng(1).standard_normal((4, 128, 256)).astype(np.float16)  # 256 KiB
    async with AsyncClient(daemon.url, daemon.token, timeout=5) as c:
        assert await c.put("layer0", kv)  # any buffer: numpy arrays too
        out = np.empty_like(kv)
        assert await c.get_into("layer0", out) == kv.nbytes
        np.testing.assert_array_equal(out, kv)
        flat = np.zeros(kv.nbytes * 2, dtype=np.uint8)
        assert await c.get_into("layer0", flat[kv.nbytes :]) == kv.nbytes  # a slice: written in place
        assert flat[kv.nbytes :].tobytes() == kv.tobytes()
        small = np.empty(100, dtype=np.uint8)
        assert await c.get_into("layer0", small) is None  # too small: a miss, not an exception
        assert c.stats["errors"] == 1


async def test_token_based_prefix_flow(daemon: Daemon) -> None:
    fp = "fp-test"
    keys = block_keys(fp, list(range(64)), 16)
    async with AsyncClient(daemon.url, daemon.token, timeout=5) as c:
        assert await c.put_many([(k, k.encode()) for k in keys[:3]]) == [True] * 3
        assert await c.lookup(keys) == 3
        longer = block_keys(fp, list(range(64)) + [7] * 16, 16)
        assert await c.lookup(longer) == 3


async def test_strict_mode_raises_server_codes(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url, daemon.token, timeout=5, strict=True) as c:
        assert await c.get("absent") is None  # a miss is not an error
        with pytest.raises(ServerError) as e:
            await c.put("big", b"x" * (2 << 20))  # over max_block_size = 1 MiB
        assert (e.value.status, e.value.code) == (413, "block_too_large")
        await c.put("k", b"abc")
        with pytest.raises(BufferTooSmall):
            await c.get_into("k", bytearray(2))
        with pytest.raises(KVStoreClientError) as ke:
            await c.get("bad/key")
        assert ke.value.code == "invalid_key"
    async with AsyncClient(daemon.url, "wrong-token", timeout=5, strict=True) as c:
        with pytest.raises(ServerError) as e:
            await c.get("k")
        assert (e.value.status, e.value.code) == (401, "unauthorized")
    async with AsyncClient(daemon.url, "wrong-token", timeout=5) as c:
        assert await c.get("k") is None  # fail-open
        assert await c.put("k2", b"x") is False
        assert c.stats["errors"] == 2


def test_token_from_env_and_file(daemon: Daemon, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_TOKEN", daemon.token)
    with Client(daemon.url, timeout=5) as c:
        assert c.put("e", b"1") is True
    monkeypatch.delenv("KVSTORE_TOKEN")
    path = daemon.workdir / "token"
    path.write_text(daemon.token + "\n")
    with Client(daemon.url, token_file=str(path), timeout=5) as c:
        assert c.get("e") == b"1"


def test_sync_client(daemon: Daemon) -> None:
    with Client([daemon.url], daemon.token, timeout=5) as c:
        assert c.put("s1", b"hello") is True
        assert c.get("s1") == b"hello"
        assert c.get_range("s1", 1, 3) == b"el"
        buf = bytearray(10)
        assert c.get_into("s1", buf) == 5 and buf[:5] == b"hello"
        assert c.exists("s1") and not c.exists("s2")
        assert c.put_many([("s2", b"a"), ("s3", b"b")]) == [True, True]
        assert c.get_many(["s2", "s9", "s3"]) == [b"a", None, b"b"]
        assert c.lookup(["s1", "s2", "s9", "s3"]) == 2
        assert c.lookup_detail(["s9", "s3"]) == [False, True]
        assert c.delete("s1") is True
        assert c.get("s1") is None
        assert c.stats["errors"] == 0
