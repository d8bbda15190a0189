"""A full disk never wedges the store: on a real small filesystem (a tmpfs
the test mounts), filled by puts and then to the last byte by another
writer, deletes, TTL and quota removals, tenant deletion and compaction
still work, and puts resume once space is freed, with no operator action.

Regression (issue 24, item 1): on a full 96 MiB tmpfs, DELETE answered 507
for most blocks (a tombstone needs space), ``POST /v1/admin/compact``
reported "no space left on device" and reclaimed nothing, and puts stayed
507 after the deletes: nothing in the API could free space.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import lmdb
import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.index import Index, IndexEntry
from kvstore.engine.reserve import RESERVE_FILE
from kvstore.engine.store import Store
from kvstore.errors import NotFound, StorageFull
from tests.fault.smallfs import MiB, fill, free_bytes, mount_tmpfs, unmount

Blocks = dict[tuple[str, str], bytes]


def config(fs: Path, **changes: str) -> StoreConfig:
    # segment_size is the default (256 MiB): the store keeps segments to a
    # sixteenth of the filesystem by itself, or compaction could never run.
    return StoreConfig.from_env(fs / "data", env={}, frame_size="64KiB", max_block_size="4MiB", **changes)


async def fill_with_puts(store: Store, rng: random.Random) -> Blocks:
    """Puts of 0.1-1.5 MB (incompressible) to both tenants until refused; what was acknowledged."""
    acked: Blocks = {}
    refused = 0
    i = 0
    while refused < 8:
        tenant = ("direct", "sealed")[i % 2]
        key, data = f"k{i:04d}", rng.randbytes(rng.randint(100_000, 1_500_000))
        i += 1
        try:
            await store.put(tenant, key, data)
        except StorageFull as e:
            assert "full" in str(e), e
            refused += 1
            continue
        acked[(tenant, key)] = data
    return acked


async def check(store: Store, acked: Blocks) -> None:
    for (tenant, key), data in acked.items():
        assert await store.get(tenant, key) == data, f"{tenant}/{key}"


async def put_until_admitted(store: Store, timeout: float = 30) -> float:
    """Seconds until a put is admitted again (none of them calls compact)."""
    t0 = time.monotonic()
    while True:
        try:
            await store.put("direct", f"after{time.monotonic_ns()}", os.urandom(256 << 10))
            return time.monotonic() - t0
        except StorageFull:
            if time.monotonic() - t0 > timeout:
                raise
            await asyncio.sleep(0.2)


async def test_full_disk_deletes_compact_and_puts_resume(small_fs: Path) -> None:
    cfg = config(small_fs)
    master = MasterKey(os.urandom(32))
    store = await Store.open(cfg, master)
    try:
        assert store.config.segment_size <= 3 * MiB and store.reserve is not None and store.reserve.whole
        await store.create_tenant("direct", "direct")
        await store.create_tenant("sealed")
        acked = await fill_with_puts(store, random.Random(7))
        assert len(acked) > 20
        await check(store, acked)
        fill(small_fs / "other-process")  # the last byte goes to someone else
        assert free_bytes(small_fs) < 64 << 10

        # Every delete succeeds on the full disk (its tombstone uses the reserve).
        doomed = list(acked)[::2]
        for tenant, key in doomed:
            assert await store.delete(tenant, key)
            del acked[(tenant, key)]
        assert store.reserve.releases >= 1

        # Compaction runs by itself while the disk is full; puts resume.
        waited = await put_until_admitted(store)
        assert store.reserve.whole, "puts resumed before the reserve was whole again"
        assert store.metrics.counter("kvstore_compaction_bytes_reclaimed_total") > 0
        assert waited < 30
        await check(store, acked)
        report = await store.compact()
        assert not report.errors, report.as_dict()
    finally:
        await store.close()

    store = await Store.open(cfg, master)  # and once more, every acknowledged block is there
    try:
        await check(store, acked)
        verify = await store.verify(deep=True)
        assert verify.ok, verify.as_dict()
    finally:
        await store.close()


async def test_restart_on_a_full_disk(small_fs: Path) -> None:
    cfg = config(small_fs)
    master = MasterKey(os.urandom(32))
    store = await Store.open(cfg, master)
    try:
        await store.create_tenant("direct", "direct")
        await store.create_tenant("sealed", ttl_s=3600)
        await store.create_tenant("doomed")
        await store.put("doomed", "x", os.urandom(2 * MiB))
        acked = await fill_with_puts(store, random.Random(11))
    finally:
        await store.close()
    fill(small_fs / "other-process")

    store = await Store.open(cfg, master)  # recovery on a full disk: no traceback, no rebuilt index
    try:
        assert not store.recovery.index_rebuilt
        await check(store, acked)
        await store.delete_tenant("doomed")  # a tenant can be deleted on a full disk
        fill(small_fs / "other-process")  # and what that freed goes to the other process too
        gone = list(acked)[1::2]
        for tenant, key in gone:
            assert await store.delete(tenant, key)
            del acked[(tenant, key)]
        await store.set_limits("sealed", ttl_s=1)  # and expiry removes blocks on a full disk too
        await asyncio.sleep(1.1)
        expired = [k for k in acked if k[0] == "sealed"]
        assert await store.expire("sealed") == len(expired)
        for k in expired:
            del acked[k]
        await put_until_admitted(store)
        await check(store, acked)
    finally:
        await store.close()


async def test_restart_with_no_reserve_left(small_fs: Path) -> None:
    """A restart on a disk full to the last byte with the reserve used up
    already (another process took what it freed): the store opens, reads,
    and answers puts 507 with a message that says what is full; once the
    other process lets go, deletes and compaction bring puts back."""
    cfg = config(small_fs)
    master = MasterKey(os.urandom(32))
    store = await Store.open(cfg, master)
    try:
        await store.create_tenant("direct", "direct")
        await store.create_tenant("sealed")
        acked = await fill_with_puts(store, random.Random(3))
    finally:
        await store.close()
    os.truncate(small_fs / "data" / RESERVE_FILE, 0)
    fill(small_fs / "other-process")
    store = await Store.open(cfg, master)
    try:
        await check(store, acked)
        with pytest.raises(StorageFull, match="the disk is full"):
            await store.put("direct", "x", b"x" * 4096)
        os.unlink(small_fs / "other-process")  # the other process lets go, blocks are deleted
        for tenant, key in list(acked)[::2]:
            assert await store.delete(tenant, key)
            del acked[(tenant, key)]
        await put_until_admitted(store)
        await check(store, acked)
    finally:
        await store.close()


def test_index_on_a_full_disk_is_storage_full_not_corruption(tmp_path: Path) -> None:
    """LMDB's ENOSPC (and a full map) is StorageFull: nothing committed, the
    index stays usable and is never taken for a damaged one."""
    where = tmp_path / "fs"
    mount_tmpfs(where, 2 * MiB)
    try:
        index = Index(where / "index")
        entry = IndexEntry(1, 4096, 8192, 4096, 100, 0, 0, bytes(16), 1)
        fill(where / "other-process")
        with pytest.raises(StorageFull, match="no space"):
            for i in range(100_000):
                index.apply("t", [(f"key-{i}-{'x' * 200}", entry)], 1, None)
        os.unlink(where / "other-process")
        index.apply("t", [("after", entry)], 1, None)  # still usable
        assert index.get("t", "after") == entry
        index.close()
        Index(where / "index").close()  # opens as it is
    finally:
        unmount(where)
    small = Index(tmp_path / "small", map_size=64 << 10)
    with pytest.raises(StorageFull, match="map is full"):
        for i in range(10_000):
            small.apply("t", [(f"key-{i}", entry)], 1, None)
    small.close()
    assert lmdb.version()  # a real LMDB


def test_lmdb_short_write_on_a_full_disk_is_storage_full(small_fs: Path, tmp_path: Path) -> None:
    """LMDB answers a short write with EIO (mdb_page_flush), which is how a
    full filesystem can show: on a full one it is StorageFull (the reserve
    then makes room), elsewhere it stays the I/O error it is."""
    from kvstore.engine.index import _lmdb_errors

    short = lmdb.Error("mdb_txn_commit: Input/output error")
    fill(small_fs / "other-process")
    with pytest.raises(StorageFull, match="short write"), _lmdb_errors("committing to the index", small_fs):
        raise short
    with pytest.raises(lmdb.Error, match="Input/output"), _lmdb_errors("committing to the index", tmp_path):
        raise short


async def test_ephemeral_blocks_go_before_anyone_is_refused(small_fs: Path) -> None:
    """G3 only: on a filling disk the ephemeral tenant's segments are evicted
    before a persistent tenant's put is refused."""
    store = await Store.open(config(small_fs), MasterKey(os.urandom(32)))
    try:
        await store.create_tenant("eph", "direct", durability="ephemeral")
        await store.create_tenant("p")
        rng = random.Random(5)
        eph = {f"e{i}": rng.randbytes(1 << 20) for i in range(16)}  # a third of the disk
        for k, v in eph.items():
            await store.put("eph", k, v)
        acked: dict[str, bytes] = {}
        while True:
            key, data = f"p{len(acked):04d}", rng.randbytes(rng.randint(500_000, 1_500_000))
            try:
                await store.put("p", key, data)
            except StorageFull:
                break
            acked[key] = data
        assert store.metrics.counter("kvstore_evictions_total", kind="ephemeral") > 0
        assert sum(map(len, acked.values())) > 36 * MiB  # more than was free beside the ephemeral blocks
        for k, v in acked.items():
            assert await store.get("p", k) == v, k
    finally:
        await store.close()


async def test_mirrored_copies_go_before_anyone_is_refused(small_fs: Path, tmp_path: Path) -> None:
    """With an object tier (a shared directory), local copies the tier holds
    are dropped on a full disk: a persistent tenant writes twice the
    filesystem's size and reads every block back."""
    cfg = config(small_fs, tier_dir=str(tmp_path / "tier"), rehydrate_reads="0")
    store = await Store.open(cfg, MasterKey(os.urandom(32)))
    try:
        await store.create_tenant("p")
        rng = random.Random(6)
        acked: dict[str, bytes] = {}
        while sum(map(len, acked.values())) < 96 * MiB:
            key, data = f"p{len(acked):04d}", rng.randbytes(rng.randint(500_000, 1_500_000))
            try:
                await store.put("p", key, data)
            except StorageFull:  # the mirror has not uploaded enough yet: persistent data waits for it
                await asyncio.sleep(0.1)
                continue
            acked[key] = data
        assert store.metrics.counter("kvstore_evictions_total", kind="mirrored") > 0
        for k, v in acked.items():
            assert await store.get("p", k) == v, k
    finally:
        await store.close()


async def test_a_tombstone_whose_index_commit_finds_the_disk_full_uses_the_reserve(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index commit of a delete's tombstone failing with ENOSPC (LMDB
    needs free pages on a full disk) is retried with part of the reserve
    released, as a failed segment write is; it was reported as a 503
    io_error ("index commit failed ... no space left") instead.

    Regression: CI's daemon disk-full run answered DELETE 503 that way."""
    master = MasterKey(os.urandom(32))
    store = await Store.open(config(small_fs), master)
    try:
        await store.create_tenant("direct", "direct")
        await store.put("direct", "k", b"v" * 100_000)
        reserve = store.reserve
        assert reserve is not None and reserve.whole
        apply, failures = Index.apply, [StorageFull("no space left on device while committing; nothing was committed")]

        def full_once(self: Index, *args: object, **kwargs: object) -> None:
            if failures:
                raise failures.pop()
            apply(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Index, "apply", full_once)
        assert await store.delete("direct", "k")
        assert not failures and reserve.releases == 1 and not reserve.whole
        with pytest.raises(NotFound):
            await store.head("direct", "k")
    finally:
        await store.close()
    store = await Store.open(config(small_fs), master)
    try:
        with pytest.raises(NotFound):  # the tombstone was committed, not left half-done
            await store.head("direct", "k")
    finally:
        await store.close()


_MANY_READERS = """
import sys, threading
from pathlib import Path
from kvstore.engine.index import Index
from tests.fault.smallfs import fill

where = Path(sys.argv[1])
index = Index(where / "index")
fill(where / "other-process")
started, release = threading.Barrier(301), threading.Event()

def read() -> None:
    with index.env.begin():  # this thread's own reader slot in lock.mdb, held open
        started.wait()
        release.wait()

threads = [threading.Thread(target=read) for _ in range(300)]
for t in threads:
    t.start()
started.wait()
release.set()
for t in threads:
    t.join()
index.close()
"""


def test_many_reader_threads_on_a_full_disk_do_not_kill_the_process(tmp_path: Path) -> None:
    """LMDB's reader table is a mapped file that ftruncate sized: each new
    reading thread writes a slot, and a slot on a page the file never had
    was SIGBUS on a full filesystem (the daemon's writer died of it). 300
    threads hold a read at once (slots over five pages) after the disk
    filled: the process lives."""
    import subprocess
    import sys

    where = tmp_path / "fs"
    mount_tmpfs(where, 2 * MiB)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MANY_READERS, str(where)],
            cwd=Path(__file__).parents[2],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    finally:
        unmount(where)
