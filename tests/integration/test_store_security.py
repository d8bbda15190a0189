"""Tenant isolation, no plaintext at rest, crypto-shredding, key rotation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store
from kvstore.errors import MasterKeyError, NotFound, StoreLocked, TenantExists, TenantNotFound
from tests.conftest import OpenStore, kv_sample

CANARY = b"CANARY-7f3a9c-THIS-PLAINTEXT-MUST-NOT-BE-ON-DISK"


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def test_no_plaintext_of_a_sealed_tenant_at_rest(store: Store) -> None:
    kv = kv_sample("minilm-l6-v2.bf16.first2MiB.bin")
    for compression_tenant in ("alice",):
        for i in range(5):
            # Canary alone, canary inside real KV, canary repeated over frames.
            data = CANARY if i == 0 else kv[: 100_000 * i] + CANARY + kv[: 70_000 * i]
            await store.put(compression_tenant, f"c{i}", data)
    await store.create_tenant("raw-sealed", "sealed", "none")  # encrypted, not compressed
    await store.put("raw-sealed", "c", CANARY * 5000)
    await store.put("direct", "c", CANARY)  # control: direct tenants are stored raw
    await store.flush()
    root = store.config.data_dir
    assert _files_containing(root, CANARY) == [root / "segments" / "direct" / "0000000000000001.seg"]
    # Also not in the registry (wrapped keys only) nor the index.
    for i in range(5):
        assert CANARY in await store.get("alice", f"c{i}")


async def test_another_tenant_cannot_read_or_see_a_key(store: Store) -> None:
    await store.put("alice", "secret", b"alice's")
    with pytest.raises(NotFound):
        await store.get("bob", "secret")
    assert not await store.exists("bob", "secret")
    assert (await store.lookup("bob", ["secret"])).present == [False]
    assert (await store.put("bob", "secret", b"bob's")).created  # bob's own key of that name
    assert await store.get("alice", "secret") == b"alice's"
    assert await store.get("bob", "secret") == b"bob's"
    assert [k async for k in store.iter_keys("bob")] == ["secret"]


async def test_delete_tenant_crypto_shreds(store: Store, open_store: OpenStore) -> None:
    await store.put("alice", "k", b"x" * 10_000)
    seg_dir = store.config.data_dir / "segments" / "alice"
    saved = store.config.data_dir.parent / "saved-alice"
    shutil.copytree(seg_dir, saved)
    await store.delete_tenant("alice")
    with pytest.raises(TenantNotFound):
        await store.get("alice", "k")
    assert not seg_dir.exists()
    assert "alice" not in [t["name"] for t in store.tenants()]
    # The name can be reused: the new tenant sees nothing of the old one.
    await store.create_tenant("alice")
    assert not await store.exists("alice", "k")
    await store.delete_tenant("alice")
    await store.close()
    # A crash after the key was destroyed but before the files went: the files
    # are orphans, removed at the next open; nothing can open them anyway.
    shutil.copytree(saved, seg_dir)
    s = await open_store()
    assert s.recovery.orphans_removed == ["alice"]
    assert not seg_dir.exists()


async def test_rotate_tenant_key(store: Store, open_store: OpenStore) -> None:
    await store.put("alice", "old", b"sealed under v1" * 1000)
    assert await store.rotate_tenant_key("alice") == 2
    await store.put("alice", "new", b"sealed under v2" * 1000)
    assert (await store.head("alice", "old")).key_version == 1
    assert (await store.head("alice", "new")).key_version == 2
    await store.close()
    s = await open_store()
    assert await s.get("alice", "old") == b"sealed under v1" * 1000
    assert await s.get("alice", "new") == b"sealed under v2" * 1000


async def test_rotate_master_key(store: Store, open_store: OpenStore, master: MasterKey) -> None:
    await store.put("alice", "k", b"v" * 5000)
    registry = (store.config.data_dir / "registry.json").read_bytes()
    new = MasterKey(os.urandom(32))
    await store.rotate_master_key(new)
    assert (store.config.data_dir / "registry.json").read_bytes() != registry
    await store.close()
    with pytest.raises(MasterKeyError, match="not the one"):
        await open_store(key=master)
    s = await open_store(key=new)
    assert await s.get("alice", "k") == b"v" * 5000


async def test_wrong_master_key_is_refused(store: Store, open_store: OpenStore) -> None:
    await store.close()
    with pytest.raises(MasterKeyError):
        await open_store(key=MasterKey(os.urandom(32)))


async def test_one_process_per_data_dir(store: Store, open_store: OpenStore) -> None:
    with pytest.raises(StoreLocked):
        await open_store()


async def test_tenant_management_errors(store: Store) -> None:
    with pytest.raises(TenantExists):
        await store.create_tenant("alice")
    with pytest.raises(Exception, match="policy"):
        await store.create_tenant("x", "open")
    with pytest.raises(Exception, match="compression must be 'none'"):
        await store.create_tenant("x", "direct", "zstd")
    with pytest.raises(TenantNotFound):
        await store.delete_tenant("nobody")
