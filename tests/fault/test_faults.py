"""Fault injection: the write and sync syscalls of segment files fail.

Only the syscalls are mocked: ``os.pwritev`` and ``os.fdatasync``, which
segment.py looks up on the ``os`` module at call time. The fakes fail only for
segment files (``*.seg``, and ``*.seg.tmp`` while one is created) under the
test's data directory, found from the fd through /proc/self/fd, so LMDB, the
registry and everything else do real I/O. The store, its files, the index and
the crypto are all real.

What must hold (appender.py): a failed batch fails whole with StorageFull
(ENOSPC, HTTP 507) or StorageIOError (EIO, 503); nothing of it is indexed or
readable; the segment is cut back to where the batch began; what was
acknowledged before still reads back, during the fault too; once the fault
is gone writes succeed again; and a reopened store finds no corruption and
every acknowledged block intact (with its index, and rebuilt without it).
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import kvstore.engine.segment
from kvstore.engine.segment import SegmentFile
from kvstore.engine.store import Store
from kvstore.errors import KVStoreError, NotFound, StorageFull, StorageIOError
from kvstore.transport.statuses import http_status
from tests.conftest import OpenStore, kv_sample

REAL_PWRITEV = os.pwritev
REAL_FDATASYNC = os.fdatasync
HALF = "half"  # a pwritev that writes half of what it is given and returns short
Action = int | str  # an errno to fail with, or HALF

Blocks = dict[tuple[str, str], bytes]


class SegmentFaults:
    """Scripted failures of pwritev / fdatasync on the segment files of one store.

    Each call on a segment file takes the next action of its queue; when the
    queue is empty it takes the ``*_always`` errno, or runs the real syscall.
    """

    def __init__(self, data_dir: Path) -> None:
        self.root = str((data_dir / "segments").resolve()) + os.sep
        self.pwritev: deque[Action] = deque()
        self.fdatasync: deque[int] = deque()
        self.pwritev_always: int | None = None
        self.fdatasync_always: int | None = None
        self.injected: Counter[str] = Counter()
        self.half_written = 0

    def clear(self) -> None:
        self.pwritev.clear()
        self.fdatasync.clear()
        self.pwritev_always = self.fdatasync_always = None

    def _is_segment(self, fd: int) -> bool:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return False
        return path.startswith(self.root) and path.endswith((".seg", ".seg.tmp"))

    def fake_pwritev(self, fd: int, buffers: Sequence[Any], offset: int, *flags: int) -> int:
        if self._is_segment(fd):
            action = self.pwritev.popleft() if self.pwritev else self.pwritev_always
            if action == HALF:
                self.injected["pwritev:half"] += 1
                views = [memoryview(b).cast("B") for b in buffers]
                want, part = sum(len(v) for v in views) // 2, []
                for v in views:
                    if want <= 0:
                        break
                    part.append(v[:want])
                    want -= len(part[-1])
                n = REAL_PWRITEV(fd, part, offset)
                self.half_written += n
                return n
            if isinstance(action, int):
                self.injected[f"pwritev:{errno.errorcode[action]}"] += 1
                raise OSError(action, os.strerror(action))
        return REAL_PWRITEV(fd, buffers, offset, *flags)

    def fake_fdatasync(self, fd: int) -> None:
        if self._is_segment(fd):
            action = self.fdatasync.popleft() if self.fdatasync else self.fdatasync_always
            if action is not None:
                self.injected[f"fdatasync:{errno.errorcode[action]}"] += 1
                raise OSError(action, os.strerror(action))
        REAL_FDATASYNC(fd)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> SegmentFaults:
    f = SegmentFaults(data_dir)
    # segment.py calls os.pwritev / os.fdatasync through the os module at call
    # time, so this replaces them process-wide; the fakes pass other files through.
    seg_os = kvstore.engine.segment.os  # type: ignore[attr-defined]
    assert seg_os is os
    monkeypatch.setattr(seg_os, "pwritev", f.fake_pwritev)
    monkeypatch.setattr(seg_os, "fdatasync", f.fake_fdatasync)
    return f


# -- helpers ------------------------------------------------------------------


def block(n: int, size: int) -> bytes:
    """A slice of a real KV cache (compressible), or random bytes for odd ``n``."""
    if n % 2:
        return os.urandom(size)
    sample = kv_sample("gemma3-270m.bf16.layers8-9.bin")
    start = (n * 77_777) % (len(sample) - size)
    return sample[start : start + size]


def segments(data_dir: Path, tenant: str) -> list[Path]:
    return sorted((data_dir / "segments" / tenant).glob("*.seg"))


async def put_all(store: Store, tenant: str, blocks: dict[str, bytes], acked: Blocks) -> None:
    assert all(s.created for s in await asyncio.gather(*(store.put(tenant, k, v) for k, v in blocks.items())))
    acked.update({(tenant, k): v for k, v in blocks.items()})


async def check_blocks(store: Store, acked: Blocks) -> None:
    for (tenant, key), data in acked.items():
        got = await store.get(tenant, key)
        assert got == data, f"{tenant}/{key} read back {len(got)} bytes that differ from the {len(data)} written"


async def check_absent(store: Store, tenant: str, keys: Sequence[str]) -> None:
    for key in keys:
        assert not await store.exists(tenant, key), f"{tenant}/{key} of a failed batch is indexed"
        with pytest.raises(NotFound):
            await store.get(tenant, key)


async def seed_store(store: Store, acked: Blocks) -> None:
    """A few acknowledged blocks in alice (sealed) and direct, of one or several 64 KiB frames."""
    for tenant in ("alice", "direct"):
        await put_all(store, tenant, {f"pre-{i}": block(i, size) for i, size in enumerate((1, 5000, 70_000))}, acked)


async def reopen_and_check(store: Store, open_store: OpenStore, data_dir: Path, acked: Blocks) -> Store:
    """Close ``store``, reopen it twice (with its index, then rebuilt from the
    segments) and check that recovery finds nothing wrong and everything acked."""
    await store.close()
    for rebuild in (False, True):
        if rebuild:
            await store.close()
            shutil.rmtree(data_dir / "index")
        store = await open_store()
        r = store.recovery
        assert r.index_rebuilt is rebuild
        assert not r.corrupt, f"recovery reports corruption: {r.as_dict()}"
        assert r.entries_dropped == 0, f"recovery dropped index entries: {r.as_dict()}"
        assert not r.truncated, f"failed batches were already cut off, nothing should be truncated: {r.as_dict()}"
        await check_blocks(store, acked)
        report = await store.verify(deep=True)
        assert report.ok, report.as_dict()
        assert report.records >= len(acked)
    return store


# -- pwritev ------------------------------------------------------------------


@pytest.mark.parametrize("tenant", ["alice", "direct"])
@pytest.mark.parametrize(
    ("err", "exc", "status"),
    [(errno.ENOSPC, StorageFull, 507), (errno.EIO, StorageIOError, 503)],
    ids=["ENOSPC", "EIO"],
)
async def test_pwritev_error_fails_the_whole_batch_and_truncates_back(
    store: Store,
    open_store: OpenStore,
    data_dir: Path,
    faults: SegmentFaults,
    tenant: str,
    err: int,
    exc: type[KVStoreError],
    status: int,
) -> None:
    acked: Blocks = {}
    await seed_store(store, acked)
    seg = segments(data_dir, tenant)[-1]
    before = seg.read_bytes()
    stats = await store.stats(tenant)

    faults.pwritev_always = err
    doomed = {f"doomed-{i}": block(i, size) for i, size in enumerate((10, 4096, 64 * 1024, 150_000))}
    results = await asyncio.gather(*(store.put(tenant, k, v) for k, v in doomed.items()), return_exceptions=True)
    assert faults.injected[f"pwritev:{errno.errorcode[err]}"] >= 1
    for r in results:
        assert isinstance(r, exc), f"expected {exc.__name__}, got {r!r}"
        assert http_status(r) == status and r.retryable
    assert isinstance(results[0], KVStoreError)
    assert f"{tenant}/{seg.name}" in str(results[0]), "the error names the segment"

    # Nothing of the batch is indexed or readable; the segment is as it was.
    await check_absent(store, tenant, list(doomed))
    assert await store.stats(tenant) == stats
    assert segments(data_dir, tenant) == [seg]
    assert seg.read_bytes() == before, "the failed batch was not cut off the segment"
    await check_blocks(store, acked)  # reads work during the fault

    faults.clear()
    await put_all(store, tenant, doomed, acked)
    assert seg.stat().st_size > len(before)
    await check_blocks(store, acked)
    await reopen_and_check(store, open_store, data_dir, acked)


async def test_partial_write_then_enospc_is_truncated_back(
    store: Store, open_store: OpenStore, data_dir: Path, faults: SegmentFaults
) -> None:
    acked: Blocks = {}
    await seed_store(store, acked)
    seg = segments(data_dir, "alice")[-1]
    before = seg.read_bytes()

    faults.pwritev.extend([HALF, errno.ENOSPC])  # pwrite_all retries the short write; that fails
    data = block(3, 200_000)
    with pytest.raises(StorageFull, match="no space left") as ei:
        await store.put("alice", "torn", data)
    assert ei.value.code == "storage_full" and http_status(ei.value) == 507
    assert faults.injected == {"pwritev:half": 1, "pwritev:ENOSPC": 1} and faults.half_written > 0
    assert seg.read_bytes() == before, "the half-written batch was not cut off the segment"
    await check_absent(store, "alice", ["torn"])
    await check_blocks(store, acked)

    await put_all(store, "alice", {"torn": data}, acked)
    await reopen_and_check(store, open_store, data_dir, acked)


async def test_write_error_while_creating_a_segment_leaves_no_file(
    store: Store, open_store: OpenStore, data_dir: Path, faults: SegmentFaults
) -> None:
    acked: Blocks = {}
    await seed_store(store, acked)
    assert segments(data_dir, "bob") == []  # bob has written nothing: its first put creates a segment

    bob = data_dir / "segments" / "bob"
    faults.pwritev_always = errno.ENOSPC
    with pytest.raises(StorageFull, match="creating the next one"):
        await store.put("bob", "first", b"x" * 100)
    assert list(bob.iterdir()) == [], "a segment file without a header was left behind"
    faults.clear()
    faults.fdatasync.append(errno.EIO)
    with pytest.raises(StorageIOError, match="creating the next one"):
        await store.put("bob", "first", b"x" * 100)
    assert list(bob.iterdir()) == []
    assert faults.injected == {"pwritev:ENOSPC": 1, "fdatasync:EIO": 1}
    await check_absent(store, "bob", ["first"])

    await put_all(store, "bob", {"first": b"x" * 100}, acked)
    assert len(segments(data_dir, "bob")) == 1
    await reopen_and_check(store, open_store, data_dir, acked)


# -- fdatasync ----------------------------------------------------------------


@pytest.mark.parametrize("sticky", [False, True], ids=["once", "until-cleared"])
@pytest.mark.parametrize(
    ("err", "exc"), [(errno.ENOSPC, StorageFull), (errno.EIO, StorageIOError)], ids=["ENOSPC", "EIO"]
)
async def test_fdatasync_error_fails_the_batch_and_truncates_back(
    store: Store,
    open_store: OpenStore,
    data_dir: Path,
    faults: SegmentFaults,
    err: int,
    exc: type[KVStoreError],
    sticky: bool,
) -> None:
    acked: Blocks = {}
    await seed_store(store, acked)
    seg = segments(data_dir, "alice")[-1]
    before = seg.read_bytes()

    if sticky:  # the sync after the truncation fails too: the appender abandons the segment
        faults.fdatasync_always = err
    else:
        faults.fdatasync.append(err)
    data = block(5, 100_000)
    with pytest.raises(exc):
        await store.put("alice", "unsynced", data)
    assert faults.injected[f"fdatasync:{errno.errorcode[err]}"] == (2 if sticky else 1)
    assert seg.read_bytes() == before, "the unsynced batch was not cut off the segment"
    await check_absent(store, "alice", ["unsynced"])
    await check_blocks(store, acked)

    faults.clear()
    await put_all(store, "alice", {"unsynced": data, "after": block(6, 3000)}, acked)
    await check_blocks(store, acked)
    segs = segments(data_dir, "alice")
    if sticky:  # later writes go to a new segment; the abandoned one keeps what it had
        assert len(segs) == 2 and segs[0] == seg
        assert seg.read_bytes() == before
    else:  # the segment stays the open one
        assert segs == [seg] and seg.stat().st_size > len(before)

    await reopen_and_check(store, open_store, data_dir, acked)
    if sticky:  # recovery sealed the abandoned segment: its records, then a footer
        assert seg.read_bytes()[: len(before)] == before
        sealed = SegmentFile.open(seg)
        try:
            assert sealed.sealed and sorted(e.key for e in sealed.read_footer()) == ["pre-0", "pre-1", "pre-2"]
        finally:
            sealed.close()


@pytest.mark.parametrize(
    ("pwritev", "fdatasync", "exc"),
    [([], [errno.EIO], StorageIOError), ([HALF, errno.ENOSPC], [], StorageFull)],
    ids=["fdatasync-EIO", "half-footer-then-ENOSPC"],
)
async def test_failed_seal_leaves_no_footer_behind(
    open_store: OpenStore,
    data_dir: Path,
    faults: SegmentFaults,
    pwritev: list[Action],
    fdatasync: list[int],
    exc: type[KVStoreError],
) -> None:
    """A failed seal must not leave (part of) a footer and trailer behind a
    segment that stays open. Regression: after a failed fdatasync the trailer
    stayed; the next small record went inside what it calls the footer, so a
    reopened store took the segment for sealed, verify() failed (footer
    checksum) and an index rebuild lost every block of the segment."""
    store = await open_store()
    await store.create_tenant("t", "sealed")
    acked: Blocks = {}
    # Fill the 1 MiB segment with small records: its footer grows past one 4 KiB record.
    n = 0
    while segments(data_dir, "t") == [] or segments(data_dir, "t")[-1].stat().st_size < 700 * 1024:
        await put_all(store, "t", {f"s{n + i:04d}": block(n + i, 100) for i in range(16)}, acked)
        n += 16
    seg = segments(data_dir, "t")[-1]
    before = seg.read_bytes()

    faults.pwritev.extend(pwritev)  # the seal's write or sync fails
    faults.fdatasync.extend(fdatasync)
    with pytest.raises(exc):
        await store.put("t", "big", block(1, 400_000))  # does not fit: the segment is sealed first
    assert not faults.pwritev and not faults.fdatasync and faults.injected.total() == len(pwritev) + len(fdatasync)
    assert seg.read_bytes() == before, "a failed seal left its footer and trailer behind"
    await check_absent(store, "t", ["big"])

    faults.clear()
    await put_all(store, "t", {"small": b"s" * 10}, acked)  # fits in the segment that is still open
    await check_blocks(store, acked)
    await reopen_and_check(store, open_store, data_dir, acked)


# -- all of it ------------------------------------------------------------------


async def test_reads_and_other_tenants_keep_working_during_a_fault(
    store: Store, open_store: OpenStore, data_dir: Path, faults: SegmentFaults
) -> None:
    acked: Blocks = {}
    await seed_store(store, acked)
    alice = segments(data_dir, "alice")[-1]
    faults.pwritev_always = errno.EIO
    faults.root = str(alice.resolve())  # only alice's open segment fails
    writes = [store.put("alice", f"w{i}", block(i, 20_000)) for i in range(6)]
    reads = [store.get(t, k) for _ in range(3) for (t, k) in acked]
    results = await asyncio.gather(*writes, *reads, return_exceptions=True)
    assert all(isinstance(r, StorageIOError) for r in results[: len(writes)]), results[: len(writes)]
    assert results[len(writes) :] == [acked[b] for _ in range(3) for b in acked]
    await put_all(store, "direct", {"during": block(8, 70_000)}, acked)  # another tenant's segment is fine
    await check_absent(store, "alice", [f"w{i}" for i in range(6)])
    faults.clear()
    await reopen_and_check(store, open_store, data_dir, acked)


async def test_after_every_kind_of_fault_the_store_recovers_clean(
    store: Store, open_store: OpenStore, data_dir: Path, faults: SegmentFaults
) -> None:
    acked: Blocks = {}
    failed: list[tuple[str, str]] = []
    await seed_store(store, acked)
    plans: list[tuple[str, list[Action], list[int]]] = [
        ("alice", [errno.ENOSPC], []),
        ("direct", [errno.EIO], []),
        ("alice", [HALF, errno.ENOSPC], []),
        ("direct", [HALF, errno.EIO], []),
        ("alice", [], [errno.ENOSPC]),
        ("direct", [], [errno.EIO]),
        ("alice", [], [errno.EIO, errno.EIO]),  # the truncation's sync fails too: segment abandoned
    ]
    for i, (tenant, pw, fds) in enumerate(plans):
        await put_all(store, tenant, {f"ok-{i}": block(i, 30_000 + i)}, acked)
        faults.pwritev.extend(pw)
        faults.fdatasync.extend(fds)
        first = next(a for a in [*pw, *fds] if isinstance(a, int))
        with pytest.raises(StorageFull if first == errno.ENOSPC else StorageIOError):
            await store.put(tenant, f"bad-{i}", block(i, 90_000))
        assert not faults.pwritev and not faults.fdatasync, f"plan {i} was not used up"
        failed.append((tenant, f"bad-{i}"))
        await check_blocks(store, acked)
    assert sum(faults.injected.values()) == sum(len(p) + len(f) for _, p, f in plans)

    store = await reopen_and_check(store, open_store, data_dir, acked)
    for tenant, key in failed:
        await check_absent(store, tenant, [key])
