"""SGLang 0.5.23: the kvstore HiCache storage backend, built by SGLang's own
StorageBackendFactory (``--hicache-storage-backend dynamic``) and run against
a real daemon with CPU tensors.

SGLang's host memory pool classes (``sglang.srt.mem_cache.pool_host``) cannot
be imported here: their package imports ``sglang.srt.configs``, which needs a
torchvision built for this torch (none exists for the CPU wheel on PyPI). The
v1 paths are therefore driven with ``LayerFirstHostPool`` below: real host
memory addressed the way SGLang's ``MHATokenToKVPoolHost`` (layout
``layer_first``) describes its pages in ``get_page_buffer_meta`` (per page, K
then V of each layer; each buffer page_size x heads x head_dim elements). It
implements only the members the backend uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kvstore_client.adapters.sglang import KVStoreHiCacheStorage
from kvstore_client.keys import check_key
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.engines.conftest import Kvstore

PAGE, HEADS, HEAD_DIM, LAYERS, SLOTS = 4, 2, 16, 3, 64


class LayerFirstHostPool:
    """Host KV memory [K|V][layer][token slot][head][dim] (bf16), paged like
    SGLang's MHATokenToKVPoolHost(layout="layer_first")."""

    def __init__(self) -> None:
        self.page_size, self.head_num, self.head_dim, self.layer_num = PAGE, HEADS, HEAD_DIM, LAYERS
        self.dtype, self.layout, self.size = torch.bfloat16, "layer_first", SLOTS
        self.kv_buffer = torch.zeros(2, LAYERS, SLOTS, HEADS, HEAD_DIM, dtype=torch.bfloat16)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        token_bytes = self.head_num * self.head_dim * self.dtype.itemsize
        base, v_offset = self.kv_buffer.data_ptr(), LAYERS * SLOTS * token_bytes
        ptrs = []
        for first in indices.tolist()[:: self.page_size]:
            for layer in range(LAYERS):
                k = base + layer * SLOTS * token_bytes + first * token_bytes
                ptrs += [k, k + v_offset]
        return ptrs, [PAGE * token_bytes] * len(ptrs)

    def page(self, first: int) -> torch.Tensor:
        return self.kv_buffer[:, :, first : first + PAGE].clone()


def storage_config(kv: Kvstore, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="org/tiny-model",
        extra_config={
            "backend_name": "kvstore",
            "module_path": "kvstore_client.adapters.sglang",
            "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1,
            "endpoints": kv.url,
            "token": kv.token,
            "timeout": 1.0,
            **extra,
        },
    )


@pytest.fixture
def backend(kvstore: Kvstore) -> Iterator[KVStoreHiCacheStorage]:
    b = StorageBackendFactory.create_backend("dynamic", storage_config(kvstore), None)
    assert isinstance(b, KVStoreHiCacheStorage) and isinstance(b, HiCacheStorage)
    yield b
    b.close()


def page_tensor(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * LAYERS * PAGE * HEADS * HEAD_DIM, generator=g).to(torch.bfloat16)


def test_get_set_exists(backend: KVStoreHiCacheStorage, kvstore: Kvstore) -> None:
    value = page_tensor(1)
    assert not backend.exists("h1")
    assert backend.get("h1", torch.empty_like(value)) is None
    assert backend.set("h1", value)
    assert backend.exists("h1")
    assert kvstore.blocks() == 1
    target = torch.empty_like(value)
    got = backend.get("h1", target)
    assert got is target and torch.equal(target, value)
    raw = backend.get("h1")  # no target: the page's bytes
    assert raw is not None and bytes(raw.numpy()) == bytes(value.view(torch.uint8).numpy())
    assert backend.get("h1", torch.empty(7, dtype=torch.bfloat16)) is None  # wrong size: a miss


def test_batch_calls(backend: KVStoreHiCacheStorage) -> None:
    keys = [f"page{i}" for i in range(5)]
    values = [page_tensor(10 + i) for i in range(5)]
    assert backend.batch_set(keys[:3], values[:3])
    assert backend.batch_exists(keys) == 3  # consecutive hits from the start
    assert backend.batch_exists([keys[4], *keys[:3]]) == 0
    assert backend.batch_exists([]) == 0
    targets = [torch.empty_like(v) for v in values]
    got = backend.batch_get(keys, targets)
    assert isinstance(got, list) and len(got) == 5
    assert all(g is t and torch.equal(t, v) for g, t, v in zip(got[:3], targets, values, strict=False))
    assert got[3] is None and got[4] is None
    assert backend.batch_set(keys[:1], []) is False  # mismatched input: False, not an exception


def test_v1_paths_with_a_registered_host_pool(kvstore: Kvstore) -> None:
    b = StorageBackendFactory.create_backend("dynamic", storage_config(kvstore), None)
    assert isinstance(b, KVStoreHiCacheStorage)
    try:
        src, dst = LayerFirstHostPool(), LayerFirstHostPool()
        torch.manual_seed(0)
        src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape).to(torch.bfloat16))
        keys = ["a", "b", "c"]
        assert b.batch_get_v1(keys, torch.arange(0, 12)) == [False] * 3  # no pool registered yet
        b.register_mem_pool_host(src)
        assert b.batch_set_v1(keys, torch.arange(8, 20)) == [True, True, True]  # pages at slots 8, 12, 16
        assert b.batch_exists(keys) == 3
        b.register_mem_pool_host(dst)  # same geometry: same keys
        assert b.batch_get_v1(["a", "x", "c"], torch.arange(32, 44)) == [True, False, True]
        assert torch.equal(dst.page(32), src.page(8)) and torch.equal(dst.page(40), src.page(16))
        assert not dst.page(36).any()  # the miss left its page untouched
        assert b.batch_get_v1(keys, torch.arange(0, 5)) == [False] * 3  # indices that are not whole pages
    finally:
        b.close()


def test_keys_are_namespaced_by_model_and_rank(kvstore: Kvstore) -> None:
    a = KVStoreHiCacheStorage(storage_config(kvstore))
    cfg = storage_config(kvstore)
    cfg.tp_rank, cfg.tp_size = 1, 2
    b = KVStoreHiCacheStorage(cfg)
    try:
        assert a.key("h") != b.key("h")
        for k in (a.key("h"), a.key("x" * 300), a.key("with space/slash")):
            check_key(k)
        a.set("h", page_tensor(3))
        assert a.exists("h") and not b.exists("h")
    finally:
        a.close()
        b.close()


def test_daemon_stopped_is_a_miss_never_none(backend: KVStoreHiCacheStorage, kvstore: Kvstore) -> None:
    value = page_tensor(5)
    assert backend.set("k", value)
    pool = LayerFirstHostPool()
    backend.register_mem_pool_host(pool)
    kvstore.stop()
    t0 = time.monotonic()
    assert backend.exists("k") is False
    assert backend.get("k", torch.empty_like(value)) is None
    assert backend.batch_get(["k", "j"], [torch.empty_like(value)] * 2) == [None, None]
    assert backend.batch_exists(["k"]) == 0
    assert backend.set("k2", value) is False
    assert backend.batch_set(["k3"], [value]) is False
    assert backend.batch_get_v1(["k"], torch.arange(0, PAGE)) == [False]
    assert backend.batch_set_v1(["k"], torch.arange(0, PAGE)) == [False]
    assert time.monotonic() - t0 < 20


def test_unknown_setting_is_refused(kvstore: Kvstore) -> None:
    with pytest.raises(ValueError, match=r"unknown setting.*\bendpoint\b"):
        StorageBackendFactory.create_backend("dynamic", storage_config(kvstore, endpoint="typo"), None)


def test_load_planning_answers_what_is_worth_loading(kvstore: Kvstore) -> None:
    """With ``prefill_tokens_per_s`` set, ``batch_exists`` answers the stored
    pages only when loading them beats recomputing them: SGLang computes
    the others instead of prefetching them. A tenant throttled to 1 kB/s
    would take seconds for what a prefill at 1000 tokens/s computes in 12 ms."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(kvstore, prefill_tokens_per_s=1000), None)
    assert isinstance(b, KVStoreHiCacheStorage)
    try:
        src = LayerFirstHostPool()
        b.register_mem_pool_host(src)
        keys = ["p0", "p1", "p2"]
        assert b.batch_set_v1(keys, torch.arange(8, 20)) == [True] * 3
        assert b.batch_exists(keys) == 3  # no figure yet (no limit, nothing measured): load, and measure
        kvstore.set_qos({"read_bytes_per_s": 1000})
        b._read_limit.forget()  # (asked again at once, not after READ_LIMIT_TTL_S)
        assert b.batch_exists(keys) == 0
        assert b.planned_recompute_pages == 3
        kvstore.set_qos({"read_bytes_per_s": 10**9})
        b._read_limit.forget()
        assert b.batch_exists(keys) == 3  # 2 ms to load against 12 ms to recompute
    finally:
        kvstore.set_qos({"read_bytes_per_s": None})
        b.close()
