"""LMCache 0.5.6: the kvstore remote storage plugin, driven by LMCache's own
RemoteBackend and LocalCPUBackend (CPU tensors) against a real daemon."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kvstore_client.adapters.lmcache import (
    MAX_KEY,
    KVStoreConnector,
    KVStoreConnectorAdapter,
    decode_header,
    encode_header,
    kvstore_key,
    lmcache_key,
)
from kvstore_client.keys import check_key
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorContext
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from tests.engines.conftest import Kvstore

MODEL = "org/tiny-model@rev 1"  # a '/' and a space: outside the kvstore key grammar
CHUNK = 16
KV_SHAPE = (2, 2, CHUNK, 2, 32)  # layers, K/V, chunk tokens, kv heads, head size
PLUGIN = "kvstore"


def plugin_config(kv: Kvstore, name: str = PLUGIN, **extra: Any) -> Any:
    prefix = f"remote_storage_plugin.{name}."
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.05,
        remote_serde="naive",
        blocking_timeout_secs=5,
        remote_storage_plugins=[name],
        extra_config={
            prefix + "module_path": "kvstore_client.adapters.lmcache",
            prefix + "class_name": "KVStoreConnectorAdapter",
            prefix + "endpoints": kv.url,
            prefix + "token": kv.token,
            prefix + "timeout": 1.0,
            **{prefix + k: v for k, v in extra.items()},
        },
    )


def metadata() -> Any:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=CHUNK,
    )


@dataclass
class Stack:
    """LMCache's storage stack with the plugin: a LocalCPUBackend (allocator)
    and a RemoteBackend whose connection is our connector, on LMCache's loop."""

    cpu: Any
    remote: Any
    loop: asyncio.AbstractEventLoop
    meta: Any

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def chunk(self, seed: int, tokens: int = CHUNK) -> Any:
        obj = self.cpu.allocate(self.meta.get_shapes(tokens), self.meta.get_dtypes(), MemoryFormat.KV_2LTD)
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(torch.bfloat16))
        return obj

    @property
    def connector(self) -> KVStoreConnector:
        inner = getattr(self.remote.connection, "_connector", self.remote.connection)
        assert isinstance(inner, KVStoreConnector)
        return inner


@pytest.fixture
def stack(kvstore: Kvstore) -> Iterator[Stack]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg, meta = plugin_config(kvstore), metadata()
    cpu = LocalCPUBackend(cfg, meta, dst_device="cpu")
    remote = RemoteBackend(cfg, meta, loop, cpu, dst_device="cpu", plugin_name=PLUGIN)
    assert remote.connection is not None, "LMCache did not create the kvstore connector"
    yield Stack(cpu, remote, loop, meta)
    remote.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def key(chunk_hash: int, **tags: str) -> Any:
    configs = {f"lmcache.tag.{k}": v for k, v in tags.items()} or None
    return CacheEngineKey(MODEL, 1, 0, chunk_hash, torch.bfloat16, request_configs=configs)


def raw_bytes(obj: Any) -> bytes:
    return bytes(obj.byte_array)


def test_put_get_roundtrip_byte_equal(stack: Stack, kvstore: Kvstore) -> None:
    k, obj = key(0xABC), stack.chunk(1)
    stack.remote.submit_put_task(k, obj).result(10)
    assert stack.remote.contains(k)
    assert kvstore.blocks() == 1
    got = stack.remote.get_blocking(k)
    assert got is not None
    assert got.get_shapes() == obj.get_shapes() and got.get_dtypes() == obj.get_dtypes()
    assert got.get_memory_format() == MemoryFormat.KV_2LTD
    assert raw_bytes(got) == raw_bytes(obj)
    assert torch.equal(got.tensor, obj.tensor)


def test_batched_calls_lmcache_uses(stack: Stack, kvstore: Kvstore) -> None:
    keys = [key(h) for h in (1, 2, 3, 4)]
    objs = [stack.chunk(10 + i) for i in range(4)]
    stack.remote.batched_submit_put_task(keys[:3], objs[:3])
    deadline = time.monotonic() + 10
    while kvstore.blocks() < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kvstore.blocks() == 3
    # Contains-prefix calls: the longest stored prefix, in one lookup.
    assert stack.remote.batched_contains(keys) == 3
    assert stack.remote.batched_contains([keys[3], *keys[:3]]) == 0
    assert stack.run(stack.remote.batched_async_contains("lookup-1", keys)) == 3
    # Batched gets: per key, and the prefetch path that stops at the first miss.
    got = stack.remote.batched_get_blocking(keys)
    assert [raw_bytes(g) for g in got[:3]] == [raw_bytes(o) for o in objs[:3]] and got[3] is None
    prefix = stack.run(stack.remote.batched_get_non_blocking("lookup-1", [keys[0], keys[1], keys[3], keys[2]]))
    assert [raw_bytes(p) for p in prefix] == [raw_bytes(objs[0]), raw_bytes(objs[1])]
    # remove, list, ping
    assert stack.remote.remove(keys[0])
    assert not stack.remote.contains(keys[0])
    assert stack.run(stack.connector.list()) == []
    assert stack.run(stack.connector.ping()) == 0


def test_partial_chunk_and_tags_roundtrip(stack: Stack) -> None:
    k, obj = key(0x5, tenant="a/b c", lora="x%y"), stack.chunk(7, tokens=5)
    stack.remote.submit_put_task(k, obj).result(10)
    got = stack.remote.get_blocking(k)
    assert got is not None and got.get_shapes() == obj.get_shapes()
    assert got.get_shapes()[0][2] == 5
    assert raw_bytes(got) == raw_bytes(obj)
    assert stack.remote.get_blocking(key(0x5)) is None  # other tags, other key


def test_misses_are_misses(stack: Stack) -> None:
    k = key(0xDEAD)
    assert not stack.remote.contains(k)
    assert stack.remote.get_blocking(k) is None
    assert stack.remote.batched_contains([k]) == 0
    assert stack.remote.batched_get_blocking([k, key(0xBEEF)]) == [None, None]
    assert stack.run(stack.remote.batched_get_non_blocking("l", [k])) == []


def test_foreign_bytes_under_a_key_are_a_miss(stack: Stack, kvstore: Kvstore) -> None:
    k = key(0x77)
    req = urllib.request.Request(
        kvstore.url + "/v1/blocks/" + kvstore_key(k.to_string()), data=b"x" * 100, method="PUT"
    )
    req.add_header("Authorization", f"Bearer {kvstore.token}")
    urllib.request.urlopen(req, timeout=10).close()
    assert stack.remote.contains(k)  # present, but not an LMCache block:
    assert stack.remote.get_blocking(k) is None
    assert stack.connector.bad_blocks == 1


def test_stopped_daemon_is_a_miss(stack: Stack, kvstore: Kvstore) -> None:
    k, obj = key(0x42), stack.chunk(3)
    stack.remote.submit_put_task(k, obj).result(10)
    kvstore.stop()
    t0 = time.monotonic()
    assert not stack.remote.contains(k)
    assert stack.remote.get_blocking(k) is None
    assert stack.remote.batched_contains([k]) == 0
    assert stack.run(stack.remote.batched_async_contains("l", [k])) == 0
    assert stack.run(stack.remote.batched_get_non_blocking("l", [k])) == []
    stack.remote.submit_put_task(key(0x43), stack.chunk(4)).result(10)  # dropped, not raised
    assert stack.run(stack.connector.ping()) == 1
    assert time.monotonic() - t0 < 15


def test_keys_map_reversibly_into_the_kvstore_grammar() -> None:
    for s in (key(0xFF).to_string(), key(1, t="é/%~ x").to_string(), "a" * 300):
        k = kvstore_key(s)
        check_key(k)
        assert len(k) <= MAX_KEY
        if k.startswith("lmc."):
            assert lmcache_key(k) == s
        else:
            assert lmcache_key(k) is None and len(s) > 100
    assert kvstore_key("a~b") != kvstore_key("a~7Eb")


def test_header_roundtrip_and_rejects() -> None:
    shapes, dtypes = [torch.Size([2, 2, 16, 64])], [torch.bfloat16]
    payload = 2 * 2 * 16 * 64 * 2
    blob = encode_header(shapes, dtypes, MemoryFormat.KV_2LTD, payload) + bytes(payload)
    assert decode_header(blob)[:3] == (shapes, dtypes, MemoryFormat.KV_2LTD)
    for bad in (blob[:10], b"XXXX" + blob[4:], blob[:7] + b"\x01" + blob[8:], blob[:-1]):
        with pytest.raises(ValueError):
            decode_header(bad)


def test_unknown_setting_is_refused(kvstore: Kvstore) -> None:
    cfg = plugin_config(kvstore, endpoint="http://typo")
    loop = asyncio.new_event_loop()
    try:
        ctx = ConnectorContext("plugin://kvstore", loop, None, cfg, metadata(), PLUGIN)
        with pytest.raises(ValueError, match=r"remote_storage_plugin\.kvstore\.endpoint\b"):
            KVStoreConnectorAdapter().create_connector(ctx)
    finally:
        loop.close()


def test_adapter_claims_kvstore_plugins_only() -> None:
    a = KVStoreConnectorAdapter()
    assert a.can_parse("plugin://kvstore") and a.can_parse("plugin://kvstore.primary")
    assert not a.can_parse("plugin://fs") and not a.can_parse("redis://localhost:6379")
