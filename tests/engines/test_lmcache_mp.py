"""kvstore as an L2 adapter of LMCache 0.5.6's multiprocess mode
(``kvstore_client.adapters.lmcache_mp``, loaded through LMCache's ``plugin``
adapter type), against a real daemon.

The contract tests run twice: on the kvstore adapter and on LMCache's own
``fs`` adapter (the reference: the same assertions must hold for it, so they
check LMCache's contract, not ours). Two levels:

* LMCache's own ``StorageManager`` (its L1, store controller and prefetch
  controller, as ``lmcache server`` runs them, built with its ``--l2-adapter``
  parser): chunks written to L1 reach L2, are dropped from L1 and prefetched
  back byte-equal; misses stop a prefix; a second manager (a restarted
  server) finds everything in L2.
* The adapter interface driven as those controllers drive it: bitmaps
  returned once, misses, loads into objects of the wrong size, locks under
  capacity pressure, the backend going away mid-run and coming back, usage
  per cache salt and delete.

"Capacity" is the backend's: the kvstore tenant's quota (the daemon evicts
its least recently used blocks); the ``fs`` adapter has none (unbounded disk),
so for it the lock assertions hold trivially and the eviction ones are not
made. "Going away" is the daemon killed (SIGKILL) and restarted on the same
data; for ``fs`` its directory moved away (a file in its place) and back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from kvstore_client.adapters.lmcache_mp import KVStoreL2AdapterConfig, kvstore_key, object_key
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.storage_manager import StorageManager

from tests.engines import l2
from tests.engines.conftest import UCX_ENV, Kvstore, make_kvstore, nixl_installed
from tests.engines.l2 import chunk, empty_like, load, lookup, raw, store
from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port

MODEL = "org/tiny-llama"  # a HuggingFace name: the '/' must survive the key mapping
KiB, MiB = 1 << 10, 1 << 20
SMALL = (2, 4, 16, 256)  # 64 KiB of bf16 (K/V, layers, tokens, hidden)
MEDIUM = (2, 4, 64, 1024)  # 1 MiB
PLUGIN = {"type": "plugin", "module_path": "kvstore_client.adapters.lmcache_mp", "class_name": "KVStoreL2Adapter"}
RECOVERY_S = 30.0


def key(n: int, **kw: Any) -> Any:
    return l2.key(n, model=MODEL, **kw)


# -- the two backends ---------------------------------------------------------------------


@dataclass
class Backend:
    """Where an adapter stores: a kvstore daemon, or a directory for LMCache's fs adapter."""

    name: str
    workdir: Path
    kv: Kvstore | None = None
    adapters: list[Any] = field(default_factory=list)

    @property
    def class_name(self) -> str:
        return "KVStoreL2Adapter" if self.kv is not None else "FSL2Adapter"

    @property
    def fs_dir(self) -> Path:
        return self.workdir / "fs"

    def spec(self, **params: Any) -> dict[str, Any]:
        if self.kv is None:
            return {"type": "fs", "base_path": str(self.fs_dir)}
        adapter_params = {"endpoints": self.kv.url, "token": self.kv.token, "timeout": 5, **params}
        return {**PLUGIN, "adapter_params": adapter_params}

    def adapter(self, **params: Any) -> Any:
        a = l2.make_adapter(self.spec(**params), self.class_name)
        self.adapters.append(a)
        return a

    def set_capacity(self, nbytes: int) -> bool:
        """Give the backend a capacity of ``nbytes``; False where it has none (fs)."""
        if self.kv is None:
            return False
        admin(self.kv.url, "PATCH", "/v1/admin/tenants/engine", {"quota_bytes": nbytes})
        return True

    def outage(self) -> None:
        if self.kv is not None:
            self.kv.stop()
            return
        self.fs_dir.rename(self.workdir / "fs.away")
        self.fs_dir.write_bytes(b"not a directory")

    def recover(self) -> None:
        if self.kv is not None:
            self.kv.daemon.start()
            return
        self.fs_dir.unlink()
        (self.workdir / "fs.away").rename(self.fs_dir)


def admin(base: str, method: str, path: str, doc: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(base + path, data=json.dumps(doc).encode() if doc else None, method=method)
    req.add_header("Authorization", f"Bearer {ADMIN}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


@pytest.fixture(params=["kvstore", "fs"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    b = Backend(request.param, tmp_path)
    if request.param == "kvstore":
        b.kv = make_kvstore(tmp_path / "kvstore")
    else:
        b.fs_dir.mkdir()
    try:
        yield b
    finally:
        for a in b.adapters:
            a.close()
        if b.kv is not None:
            b.kv.stop()


def idle(adapter: Any) -> None:
    """Wait until the adapter has nothing in flight (the kvstore adapter's
    unlocks release leases in the background; fs has no such work)."""
    if not hasattr(adapter, "client"):
        return
    deadline = time.monotonic() + l2.TASK_TIMEOUT_S
    while adapter.report_status()["tasks_in_flight"]:
        assert time.monotonic() < deadline, "tasks still in flight"
        time.sleep(0.01)


# -- through LMCache's StorageManager -------------------------------------------------------


class Stored(L2AdapterListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.keys: set[Any] = set()

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        self.keys.update(keys)

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        pass


def manager(b: Backend) -> Any:
    """A StorageManager as ``lmcache server`` makes one from its command line."""
    argv = ["--l1-size-gb", "0.0625", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(b.spec())]
    return StorageManager(l2.parser_quiet(lambda: parse_args(argv)))


def write(sm: Any, keys: list[Any], layout: Any, seed: int) -> dict[Any, bytes]:
    """Write chunks into L1 as the MP server does for a store request, and
    wait until the store controller has put them in L2."""
    listener = Stored()
    sm.register_l2_listener(listener)
    objs = sm.reserve_write(keys, layout)
    assert set(objs) == set(keys)
    g = torch.Generator().manual_seed(seed)
    written = {}
    for k, o in objs.items():
        o.tensor.copy_(torch.randn(tuple(o.tensor.shape), generator=g).to(o.tensor.dtype))
        written[k] = raw(o)
    sm.finish_write(keys)
    deadline = time.monotonic() + l2.TASK_TIMEOUT_S
    while not listener.keys >= set(keys):
        assert time.monotonic() < deadline, "chunks did not reach L2"
        time.sleep(0.01)
    return written


def delete_l1(sm: Any, keys: list[Any]) -> int:
    """Drop ``keys`` from L1; how many went. LMCache's store controller
    releases a chunk's L1 lock just after it tells its listeners the chunk
    is in L2, so a delete right after :func:`write` may find a few still
    locked (``skipped``): it is tried again (missing keys are a no-op)."""
    total = 0
    deadline = time.monotonic() + l2.TASK_TIMEOUT_S
    while True:
        deleted, skipped = sm.delete_l1_keys(keys)
        total += deleted
        if not skipped:
            return total
        assert time.monotonic() < deadline, f"{skipped} chunks stayed locked in L1"
        time.sleep(0.02)


def prefetch(sm: Any, keys: list[Any], layout: Any) -> tuple[list[bool], dict[Any, bytes], int]:
    """Prefetch ``keys`` into L1 (LMCache's prefix policy): per key whether it
    was hit, the bytes of the hits, and how many came from L2."""
    spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
    handle = sm.submit_prefetch_task(spec)
    assert sm.wait_prefetch_status(handle, l2.TASK_TIMEOUT_S)
    result = sm.query_prefetch_status(handle)
    hits = [bool(result.hit_cells[0].test(i)) for i in range(len(keys))]
    got: dict[Any, bytes] = {}
    hit_keys = [k for k, h in zip(keys, hits, strict=True) if h]
    if hit_keys:
        owners = result.l1_owners or None
        with sm.read_prefetched_results(hit_keys, owners) as objs:
            assert objs is not None
            got = {k: raw(o) for k, o in zip(hit_keys, objs, strict=True)}
        sm.finish_read_prefetched(hit_keys, 1, owners)
    return hits, got, result.l2_hit_count


def test_storage_manager_roundtrip(backend: Backend) -> None:
    layout = MemoryLayoutDesc(shapes=[torch.Size(MEDIUM)], dtypes=[torch.bfloat16])
    keys = [key(i) for i in range(6)]
    salted = [key(i, salt="user-7") for i in range(3)]
    sm = manager(backend)
    try:
        written = write(sm, keys, layout, seed=1) | write(sm, salted, layout, seed=2)
        assert delete_l1(sm, keys + salted) == 9

        hits, got, from_l2 = prefetch(sm, keys, layout)
        assert hits == [True] * 6 and from_l2 == 6
        assert all(got[k] == written[k] for k in keys)

        # A miss ends the prefix: what follows it is not loaded.
        sm.delete_l1_keys(keys)
        hits, got, from_l2 = prefetch(sm, [keys[0], key(99), keys[2]], layout)
        assert hits == [True, False, False] and from_l2 == 1
        assert got[keys[0]] == written[keys[0]]
        # Another salt is another key: user-8 does not see user-7's chunks.
        hits, _, _ = prefetch(sm, [key(0, salt="user-8")], layout)
        assert hits == [False]
    finally:
        sm.close()

    # A second server (L1 empty): everything comes from L2.
    sm = manager(backend)
    try:
        hits, got, from_l2 = prefetch(sm, salted + keys, layout)
        assert hits == [True] * 9 and from_l2 == 9
        assert got == {k: written[k] for k in salted + keys}
    finally:
        sm.close()


# -- the adapter interface ----------------------------------------------------------------


def test_roundtrip_misses_and_sizes(backend: Backend) -> None:
    a = backend.adapter()
    keys = [key(1), key(2, rank=3, group=1), key(3, salt="user-7"), key(4)]
    objs = [chunk(MEDIUM, 1), chunk(SMALL, 2), chunk(SMALL, 3), chunk((2, 4, 7, 96), 4, torch.float32)]
    result = store(a, keys, objs)
    assert result.is_successful() and result.bytes_transferred() == sum(o.get_size() for o in objs)

    other = backend.adapter()  # another server on the same store
    missing = [key(1, rank=1), key(3, salt="user-8"), key(3), key(0xDEAD)]
    assert lookup(other, keys + missing) == [True] * 4 + [False] * 4
    dst = [empty_like(o) for o in objs]
    assert load(other, keys, dst) == [True] * 4
    assert [raw(d) for d in dst] == [raw(o) for o in objs]
    other.submit_unlock(keys)

    # Per key: a miss and an object of the wrong size fail, the rest load.
    out = [empty_like(objs[1]), empty_like(objs[1]), empty_like(objs[0]), empty_like(objs[2])]
    assert load(other, [keys[1], missing[3], keys[1], keys[2]], out) == [True, False, False, True]
    assert raw(out[0]) == raw(objs[1]) and raw(out[3]) == raw(objs[2])

    # Storing the same chunks again succeeds (first write wins).
    assert store(other, keys[:2], objs[:2]).is_successful()
    assert lookup(other, []) == []


def test_locks_hold_under_capacity_pressure(backend: Backend) -> None:
    """Locked chunks survive a flood of three times the capacity; each lock
    needs its own unlock; once unlocked they are evicted like the rest, and
    writes never stop succeeding."""
    capped = backend.set_capacity(1 * MiB)
    a = backend.adapter()
    locked = [key(i) for i in range(4)]  # 256 KiB
    lobjs = [chunk(SMALL, i) for i in range(4)]
    assert store(a, locked, lobjs).is_successful()
    assert lookup(a, locked) == [True] * 4  # the prefetch controller's lookup and lock
    assert lookup(a, locked) == [True] * 4  # a second request locks them too

    n = 100

    def flood(rounds: int = 6) -> list[Any]:
        nonlocal n
        batches = []
        for _ in range(rounds):  # 6 x 8 x 64 KiB = 3 MiB
            ks = [key(n + i) for i in range(8)]
            os_ = [chunk(SMALL, n + i) for i in range(8)]
            n += 8
            assert store(a, ks, os_).is_successful()
            batches.append((ks, os_))
        return batches

    def loads_locked() -> None:
        dst = [empty_like(o) for o in lobjs]
        assert load(a, locked, dst) == [True] * 4
        assert [raw(d) for d in dst] == [raw(o) for o in lobjs]

    first = flood()
    loads_locked()
    if capped:  # the flood evicted its own oldest chunks, not the locked ones
        assert not any(lookup(a, first[0][0]))

    a.submit_unlock(locked)  # one of the two locks
    idle(a)
    flood()
    loads_locked()

    a.submit_unlock(locked)
    idle(a)
    last = flood()
    ks, os_ = last[-1]
    dst = [empty_like(o) for o in os_]
    assert load(a, ks, dst) == [True] * 8 and [raw(d) for d in dst] == [raw(o) for o in os_]
    if capped:  # unlocked: evicted like any other old chunk
        assert not any(lookup(a, locked))


def test_backend_outage_fails_tasks_then_recovers(backend: Backend) -> None:
    a = backend.adapter()
    keys = [key(i) for i in range(4)]
    objs = [chunk(SMALL, i) for i in range(4)]
    assert store(a, keys, objs).is_successful()

    backend.outage()
    later = [key(10 + i) for i in range(4)]
    lobjs = [chunk(SMALL, 10 + i) for i in range(4)]
    assert not store(a, later, lobjs).is_successful()
    assert lookup(a, keys) == [False] * 4
    assert load(a, keys, [empty_like(o) for o in objs]) == [False] * 4
    a.submit_unlock(keys)  # nothing was locked: a no-op, never an error

    backend.recover()
    deadline = time.monotonic() + RECOVERY_S
    while lookup(a, keys) != [True] * 4:  # the client's breaker lets a probe through after its cooldown
        assert time.monotonic() < deadline, "no recovery"
        time.sleep(0.2)
    dst = [empty_like(o) for o in objs]
    assert load(a, keys, dst) == [True] * 4 and [raw(d) for d in dst] == [raw(o) for o in objs]
    assert store(a, later, lobjs).is_successful()
    assert lookup(a, later) == [True] * 4


def test_usage_per_salt_and_delete(backend: Backend) -> None:
    a = backend.adapter()
    keys = [key(1, salt="a"), key(2, salt="a"), key(3, salt="b"), key(4)]
    objs = [chunk(SMALL, 1), chunk(SMALL, 2), chunk(MEDIUM, 3), chunk(SMALL, 4)]
    assert store(a, keys, objs).is_successful()
    usage = a.get_usage()
    assert dict(usage.bytes_by_cache_salt) == {"a": 128 * KiB, "b": 1 * MiB, "": 64 * KiB}
    assert usage.total_bytes_used == 1 * MiB + 192 * KiB
    other = backend.adapter()  # another server storing the same chunks: they were there, it counts nothing
    assert store(other, keys, objs).is_successful()
    assert other.get_usage().total_bytes_used == 0 and a.get_usage().total_bytes_used == 1 * MiB + 192 * KiB

    a.delete(keys[:2])
    assert lookup(a, keys) == [False, False, True, True]
    a.submit_unlock(keys[2:])
    assert dict(a.get_usage().bytes_by_cache_salt) == {"b": 1 * MiB, "": 64 * KiB}
    assert load(a, keys[:1], [empty_like(objs[0])]) == [False]


# -- the kvstore adapter only ----------------------------------------------------------------


@pytest.fixture
def kvstore_backend(tmp_path: Path) -> Iterator[Backend]:
    b = Backend("kvstore", tmp_path, make_kvstore(tmp_path / "kvstore"))
    try:
        yield b
    finally:
        for a in b.adapters:
            a.close()
        assert b.kv is not None
        b.kv.stop()


def test_delete_skips_locked_chunks(kvstore_backend: Backend) -> None:
    """LMCache's own L2 eviction calls delete: a chunk a lookup locked is not
    deleted under the prefetch that is about to load it."""
    a = kvstore_backend.adapter()
    keys = [key(1), key(2)]
    objs = [chunk(SMALL, 1), chunk(SMALL, 2)]
    assert store(a, keys, objs).is_successful()
    assert lookup(a, keys[:1]) == [True]
    a.delete(keys)
    assert lookup(a, keys) == [True, False]
    a.submit_unlock(keys[:1])
    a.submit_unlock(keys[:1])
    idle(a)
    a.delete(keys)
    assert lookup(a, keys) == [False, False]


def test_list_l2_keys_pages_by_model(kvstore_backend: Backend) -> None:
    a = kvstore_backend.adapter()
    mine = [key(i, salt="user-7" if i % 2 else "") for i in range(7)]
    theirs = [l2.key(1, model="other/model"), l2.key(2, model="org/tiny-llama-2")]
    assert store(a, mine + theirs, [chunk(SMALL, i) for i in range(9)]).is_successful()
    listed, cursor = [], None
    while True:
        page = a.list_l2_keys(model_name=MODEL, page_size=3, cursor=cursor)
        assert len(page.entries) <= 3
        listed += page.entries
        cursor = page.next_page_token
        if cursor is None:
            break
    assert len(listed) == len(mine)
    assert {(e.key.to_object_key(), e.size_bytes) for e in listed} == {(k, 64 * KiB) for k in mine}
    everything = a.list_l2_keys(page_size=100)
    assert {e.key.to_object_key() for e in everything.entries} == set(mine + theirs)
    with pytest.raises(ValueError):
        a.list_l2_keys(page_size=0)
    with pytest.raises(ValueError):
        a.list_l2_keys(cursor="7:x")


def test_lock_lease_expires_without_unlock(kvstore_backend: Backend) -> None:
    """A server that never unlocks (it died) holds nothing for longer than lock_lease_s."""
    kvstore_backend.set_capacity(512 * KiB)
    a = kvstore_backend.adapter(lock_lease_s=1)
    locked = [key(i) for i in range(2)]
    assert store(a, locked, [chunk(SMALL, i) for i in range(2)]).is_successful()
    assert lookup(a, locked) == [True, True]
    time.sleep(1.5)
    for r in range(4):  # 1 MiB of newer chunks: the expired lock protects nothing
        assert store(a, [key(100 + 4 * r + i) for i in range(4)], [chunk(SMALL, i) for i in range(4)]).is_successful()
    assert lookup(a, locked) == [False, False]


def test_unix_socket_loads_read_segment_files(tmp_path: Path) -> None:
    """With a ``unix:`` endpoint on the same host, loads of a direct tenant's
    chunks read the segment files into LMCache's objects (read plans), not HTTP bodies."""
    sock = tmp_path / "kv.sock"
    env = daemon_env(tmp_path, segment_size="16MiB", durability="interval")
    d = Daemon(tmp_path / "data", free_port(), env, extra=["--listen", f"unix:{sock}"])
    d.start()
    try:
        token = admin(d.base, "POST", "/v1/admin/tenants", {"name": "engine", "policy": "direct"})["token"]
        a = l2.make_adapter(
            {**PLUGIN, "adapter_params": {"endpoints": f"unix:{sock}", "token": token}}, PLUGIN["class_name"]
        )
        try:
            keys = [key(i) for i in range(3)]
            objs = [chunk(MEDIUM, i) for i in range(3)]
            assert store(a, keys, objs).is_successful()
            assert lookup(a, keys) == [True] * 3
            dst = [empty_like(o) for o in objs]
            assert load(a, keys, dst) == [True] * 3
            assert [raw(x) for x in dst] == [raw(o) for o in objs]
            assert a.client.stats["plan_reads"] == 3
            a.submit_unlock(keys)
        finally:
            a.close()
    finally:
        d.stop(signal.SIGKILL)


@pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (deploy/setup-engines.sh installs it)")
def test_nixl_transport_moves_chunks_one_sided(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``transport: nixl``: stores are READ by the daemon's agent from the L1
    objects, loads READ into them (UCX over TCP here), one control call per batch."""
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)
    kv = make_kvstore(tmp_path / "kvstore", nixl=True)
    b = Backend("kvstore", tmp_path, kv)
    try:
        a = b.adapter(transport="nixl", nixl_devices="lo")
        keys = [key(i) for i in range(4)]
        objs = [chunk(MEDIUM, i) for i in range(4)]
        assert store(a, keys, objs).is_successful()
        assert lookup(a, keys) == [True] * 4
        dst = [empty_like(o) for o in objs]
        before = kv.nixl_reads()
        assert load(a, keys, dst) == [True] * 4
        assert [raw(d) for d in dst] == [raw(o) for o in objs]
        a.submit_unlock(keys)
        stats = a.client.stats
        assert stats["nixl_reads"] == 4 and stats["nixl_writes"] == 4 and stats["nixl_fallbacks"] == 0, stats
        assert kv.nixl_reads() - before == 1  # one control call for the batch
    finally:
        for x in b.adapters:
            x.close()
        kv.stop()


def test_key_mapping_is_reversible() -> None:
    cases = [
        key(1),
        key(2, rank=0x04020301, group=7, salt="user-7"),
        ObjectKey(chunk_hash=b"\x00" * 8, model_name="a b/ü~x:y", kv_rank=0, cache_salt="s p~a.ce"),
        ObjectKey(chunk_hash=os.urandom(32), model_name="m", kv_rank=-1, object_group_id=0, cache_salt="é" * 10),
    ]
    seen = set()
    for k in cases:
        kv = kvstore_key(k)
        assert len(kv) <= 256 and kv.isascii()
        assert object_key(kv) == k, kv
        seen.add(kv)
    assert len(seen) == len(cases)
    # Keys past the daemon's 256 characters are hashed (stored and loaded, not listed).
    long = ObjectKey(chunk_hash=b"\x01" * 32, model_name="m" * 100, kv_rank=0, cache_salt="~" * 128)
    assert kvstore_key(long).startswith("lmp~") and object_key(kvstore_key(long)) is None
    assert object_key("lmc.other-adapter") is None and object_key("lmp@x@zz@0@00") is None


def test_adapter_params_are_checked() -> None:
    with pytest.raises(ValueError, match=r"unknown setting.*endpoint\b"):
        KVStoreL2AdapterConfig.from_dict({"endpoint": "http://127.0.0.1:1"})
    with pytest.raises(ValueError, match="endpoints"):
        KVStoreL2AdapterConfig.from_dict({})
    with pytest.raises(ValueError, match="lock_lease_s"):
        KVStoreL2AdapterConfig.from_dict({"endpoints": "http://127.0.0.1:1", "lock_lease_s": 900})
    cfg = KVStoreL2AdapterConfig.from_dict({"endpoints": "http://127.0.0.1:1", "max_capacity_bytes": 1 << 30})
    assert cfg.max_capacity_bytes == 1 << 30 and cfg.lock_lease_s == 60.0


def _find(doc: Any, pred: Any) -> list[Any]:
    """Every dict inside ``doc`` for which ``pred`` holds."""
    found = [doc] if isinstance(doc, dict) and pred(doc) else []
    children = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else []
    for c in children:
        found += _find(c, pred)
    return found


def test_lmcache_server_starts_with_the_adapter(kvstore_backend: Backend, tmp_path: Path) -> None:
    """``lmcache server`` (LMCache's MP server, on CPU) with the command line
    of docs/engines.md builds the adapter; its status endpoint reports it healthy."""
    assert kvstore_backend.kv is not None
    spec = kvstore_backend.spec()
    http_port = free_port()
    argv = [str(Path(sys.executable).parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(free_port())]
    argv += ["--http-host", "127.0.0.1", "--http-port", str(http_port), "--l1-size-gb", "0.0625"]
    argv += ["--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)]
    log = tmp_path / "lmcache-server.log"
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "lmcache server did not answer /status"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
                    status = json.loads(r.read())
                break
            except OSError:
                time.sleep(0.5)
        ours = _find(status, lambda d: d.get("type") == "KVStoreL2Adapter")
        assert len(ours) == 1, status
        assert ours[0]["is_healthy"] is True
        assert ours[0]["endpoints"] == {kvstore_backend.kv.url: "closed"}

        # Chunks another server stored are listed by this one's cache API.
        keys = [key(1), key(2, salt="user-7")]
        assert store(kvstore_backend.adapter(), keys, [chunk(SMALL, 1), chunk(SMALL, 2)]).is_successful()
        url = f"http://127.0.0.1:{http_port}/cache/objects?tier=l2&model_name={MODEL}"
        with urllib.request.urlopen(url, timeout=10) as r:
            listed = json.loads(r.read())
        got = {(e["key"]["chunk_hash_hex"], e["key"]["cache_salt"], e["size_bytes"]) for e in listed["entries"]}
        assert got == {(k.chunk_hash.hex(), k.cache_salt, 64 * KiB) for k in keys}, listed
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_load_planning_reports_a_found_prefix_only_where_loading_beats_recompute(
    kvstore_backend: Backend,
) -> None:
    """``prefill_tokens_per_s`` set: a lookup weighs the leading run of found
    chunks (their bytes from the lookup's layouts, LMCache's chunk of
    ``chunk_tokens``) against recomputing them. With the tenant's read limit
    at 1 kB/s the chunks are found but not reported (LMCache recomputes them)
    and their locks are released; with a high limit they are, and the load
    runs under the recompute deadline (get_prefix) and fills every chunk."""
    kv = kvstore_backend.kv
    assert kv is not None
    keys = [key(i) for i in range(4)]
    objs = [chunk(MEDIUM, i) for i in range(4)]
    plain = kvstore_backend.adapter()
    assert store(plain, keys, objs).is_successful()
    planned = kvstore_backend.adapter(prefill_tokens_per_s=2000, chunk_tokens=256)
    kv.set_qos({"read_bytes_per_s": 1000})
    try:
        assert lookup(planned, keys, objs) == [False] * 4
    finally:
        kv.set_qos({"read_bytes_per_s": None})
    assert planned.planned_recompute == 4
    idle(planned)
    assert not planned._held  # nothing reported, nothing kept locked
    fresh = kvstore_backend.adapter(prefill_tokens_per_s=2000, chunk_tokens=256)
    kv.set_qos({"read_bytes_per_s": 10**10})
    try:
        assert lookup(fresh, keys, objs) == [True] * 4  # 4 MiB at 10 GB/s beats 0.5 s of prefill
        out = [empty_like(o) for o in objs]
        assert load(fresh, keys, out) == [True] * 4
        assert [raw(o) for o in out] == [raw(o) for o in objs]
        assert fresh._deadline(4) == pytest.approx(4 * 256 / 2000)  # the load's deadline: recomputing it
    finally:
        kv.set_qos({"read_bytes_per_s": None})
    fresh.submit_unlock(keys)
    assert fresh.planned_recompute == 0
    # Without layouts the chunk size is unknown: nothing to weigh, the hits are reported.
    assert lookup(planned, keys) == [True] * 4
    with pytest.raises(ValueError, match="chunk_tokens"):
        KVStoreL2AdapterConfig({"endpoints": kv.url, "chunk_tokens": 0})
