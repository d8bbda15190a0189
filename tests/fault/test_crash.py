"""Crash test: SIGKILL a writing process at random moments, then check the store.

A child process (crash_writer.py) writes blocks to a sealed and a direct tenant
with several puts in flight and prints one ``ACK`` line per acknowledged put
(``DELETING`` before a delete, ``DEL`` once it is acknowledged). The parent
kills it with SIGKILL at a random moment (or the child kills itself at a chosen
syscall), reopens the store in-process on the same data directory and checks:

* every acknowledged block, of this run or any earlier one, reads back
  byte-identical (its sha256 matches the ACK) unless a delete of it was
  started, and acknowledged deletions stay deleted;
* every block the store holds, acknowledged or not, is exactly the block its
  key names (never wrong or partial data);
* recovery reports no corruption and drops no index entry, and ``verify()`` is ok.

KVSTORE_CRASH_ITERATIONS (20 or more) sets the number of kills of the main loop.
KVSTORE_CRASH_SEED fixes the block contents and the kill delays (the seed is in
every failure message; where a kill lands still depends on timing).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.recovery import RecoveryReport
from kvstore.engine.store import Store
from tests.fault.crash_writer import CRASH_ENV, MASTER_ENV, TENANTS, block_content, store_config

ROOT = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("crash_writer.py")
ITERATIONS = max(20, int(os.environ.get("KVSTORE_CRASH_ITERATIONS", "20")))
REBUILD_ITERATIONS = int(os.environ.get("KVSTORE_CRASH_REBUILD_ITERATIONS", "9"))
KILL_DELAY_S = (0.05, 0.6)
READY_TIMEOUT_S = 30.0
READ_CONCURRENCY = 16

Block = tuple[str, str]  # tenant, key


@dataclass
class Ledger:
    """What the children reported as acknowledged, over all runs."""

    acked: dict[Block, str] = field(default_factory=dict)  # -> sha256 hex
    deleting: set[Block] = field(default_factory=set)  # a delete was started: may be gone
    deleted: set[Block] = field(default_factory=set)  # the delete was acknowledged: must be gone


@dataclass
class Totals:
    kills: int = 0
    kills_before_ready: int = 0
    runs_with_acks: int = 0
    acks: int = 0
    deletes: int = 0
    index_deleted: int = 0
    index_rebuilt: int = 0
    records_replayed: int = 0
    segments_from_footer: int = 0
    truncations: int = 0
    bytes_truncated: int = 0
    segments_sealed: int = 0
    blocks_checked: int = 0
    bytes_checked: int = 0

    def add_recovery(self, r: RecoveryReport) -> None:
        self.index_rebuilt += r.index_rebuilt
        self.records_replayed += r.records_replayed
        self.segments_from_footer += r.segments_from_footer
        self.truncations += len(r.truncated)
        self.bytes_truncated += sum(n for _, _, n in r.truncated)
        self.segments_sealed += len(r.sealed)


def _spawn(
    data_dir: Path, run: int, seed: str, master: MasterKey, out: Path, err: Path, crash_at: str = ""
) -> subprocess.Popen[bytes]:
    env = {**os.environ, MASTER_ENV: master.secret.hex(), CRASH_ENV: crash_at, "PYTHONPATH": str(ROOT)}
    with out.open("wb") as fout, err.open("wb") as ferr:
        return subprocess.Popen(
            [sys.executable, str(WRITER), str(data_dir), str(run), seed],
            stdout=fout,
            stderr=ferr,
            cwd=ROOT,
            env=env,
        )


async def _wait_ready(proc: subprocess.Popen[bytes], out: Path, err: Path, where: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not out.read_bytes().startswith(b"READY\n"):
        if proc.poll() is not None:
            pytest.fail(f"{where}: writer exited with {proc.returncode} before READY:\n{err.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"{where}: writer not READY after {READY_TIMEOUT_S} s:\n{err.read_text()}")
        await asyncio.sleep(0.01)


def _parse(out: Path, ledger: Ledger, totals: Totals) -> int:
    """Add the complete lines of ``out`` to ``ledger``; return how many ACKs."""
    acks = 0
    text = out.read_text()
    lines = text.split("\n")[:-1]  # the last piece is empty or a line cut short by the kill
    for line in lines:
        word, *rest = line.split(" ")
        if word == "ACK":
            tenant, key, digest = rest
            assert (tenant, key) not in ledger.acked, f"key {tenant}/{key} acknowledged twice"
            ledger.acked[(tenant, key)] = digest
            acks += 1
        elif word == "DELETING":
            tenant, key = rest
            assert (tenant, key) in ledger.acked, f"deleting {tenant}/{key}, which was never acknowledged"
            ledger.deleting.add((tenant, key))
        elif word == "DEL":
            tenant, key = rest
            assert (tenant, key) in ledger.deleting, f"deleted {tenant}/{key} without DELETING first"
            ledger.deleted.add((tenant, key))
            totals.deletes += 1
        else:
            assert word == "READY" and not rest, f"unexpected line from the writer: {line!r}"
    totals.acks += acks
    return acks


async def _check_store(store: Store, seed: str, ledger: Ledger, totals: Totals, where: str) -> None:
    """Read every block the store holds; compare with the ledger and the key's content."""
    r = store.recovery
    assert not r.corrupt, f"{where}: recovery reported corruption after a SIGKILL: {r.as_dict()}"
    assert r.entries_dropped == 0, f"{where}: recovery dropped index entries (acknowledged data?): {r.as_dict()}"
    names = {t["name"] for t in store.tenants()}
    assert names <= {name for name, _ in TENANTS}, f"{where}: unexpected tenants {names}"
    acked_tenants = {t for t, _ in ledger.acked}
    assert acked_tenants <= names, f"{where}: tenants with acknowledged blocks are gone: {acked_tenants - names}"

    present: dict[Block, str] = {}
    wrong: list[str] = []
    sem = asyncio.Semaphore(READ_CONCURRENCY)

    async def read(tenant: str, key: str) -> None:
        async with sem:
            data = await store.get(tenant, key)
        digest = hashlib.sha256(data).hexdigest()
        present[(tenant, key)] = digest
        expect = block_content(seed, key)
        if data != expect:
            wrong.append(f"{tenant}/{key}: {len(data)} bytes sha256 {digest}, expected {len(expect)} bytes")
        totals.blocks_checked += 1
        totals.bytes_checked += len(data)

    reads = []
    for tenant in sorted(names):
        async for key in store.iter_keys(tenant):
            reads.append(read(tenant, key))
    await asyncio.gather(*reads)
    assert not wrong, f"{where}: blocks read back wrong: {wrong[:10]}"

    lost = sorted(b for b in ledger.acked if b not in ledger.deleting and b not in present)
    assert not lost, f"{where}: {len(lost)} acknowledged blocks are gone, e.g. {lost[:10]}"
    changed = sorted(b for b, d in ledger.acked.items() if b in present and present[b] != d)
    assert not changed, f"{where}: acknowledged blocks read back with another sha256: {changed[:10]}"
    resurrected = sorted(ledger.deleted & present.keys())
    assert not resurrected, f"{where}: blocks whose deletion was acknowledged are back: {resurrected[:10]}"
    for tenant in names:
        stats = await store.stats(tenant)
        held = sum(1 for t, _ in present if t == tenant)
        assert stats.blocks == held, f"{where}: tenant {tenant} stats say {stats.blocks} blocks, index holds {held}"

    report = await store.verify()
    assert report.ok, f"{where}: verify failed: {report.as_dict()}"
    assert report.records >= len(present)


async def _reopen_and_check(
    cfg: StoreConfig, master: MasterKey, seed: str, ledger: Ledger, totals: Totals, where: str
) -> RecoveryReport:
    store = await Store.open(cfg, master)
    try:
        totals.add_recovery(store.recovery)
        await _check_store(store, seed, ledger, totals, where)
        return store.recovery
    finally:
        await store.close()


async def _crash_loop(tmp_path: Path, master: MasterKey, iterations: int, drop_index: bool) -> Totals:
    seed = os.environ.get("KVSTORE_CRASH_SEED") or os.urandom(6).hex()
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    cfg = store_config(data_dir)
    ledger, totals = Ledger(), Totals()
    t0 = time.monotonic()
    for run in range(iterations):
        where = f"seed={seed} run={run}"
        if drop_index and run % 3 == 1 and (data_dir / "index").exists():
            # The child rebuilds the index, and may be killed while it does.
            shutil.rmtree(data_dir / "index")
            totals.index_deleted += 1
        out, err = tmp_path / f"run{run}.out", tmp_path / f"run{run}.err"
        proc = _spawn(data_dir, run, seed, master, out, err)
        try:
            if rng.random() < 0.2:  # from the start: may land in start-up or recovery
                await asyncio.sleep(rng.uniform(*KILL_DELAY_S))
            else:
                await _wait_ready(proc, out, err, where)
                await asyncio.sleep(rng.uniform(*KILL_DELAY_S))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, f"{where}: writer exited with {proc.returncode}:\n{err.read_text()}"
        totals.kills += 1
        if not out.read_bytes().startswith(b"READY\n"):
            totals.kills_before_ready += 1
        if _parse(out, ledger, totals):
            totals.runs_with_acks += 1

        rebuild = drop_index and run % 3 == 0
        if rebuild:  # the parent's open rebuilds the index from the segments
            shutil.rmtree(data_dir / "index", ignore_errors=True)
            totals.index_deleted += 1
        r = await _reopen_and_check(cfg, master, seed, ledger, totals, where)
        if rebuild and ledger.acked:
            assert r.index_rebuilt, f"{where}: index deleted but not rebuilt: {r.as_dict()}"

    # Deep scrub once at the end: every live frame opened (GCM tags, zstd).
    store = await Store.open(cfg, master)
    try:
        report = await store.verify(deep=True)
        assert report.ok, f"seed={seed}: deep verify failed: {report.as_dict()}"
        assert report.frames_opened > 0
    finally:
        await store.close()

    print(
        f"\ncrash loop seed={seed} drop_index={drop_index} in {time.monotonic() - t0:.1f} s: {totals}",
        file=sys.stderr,
    )
    # The kills must have landed while blocks were being written, or nothing was tested.
    assert totals.acks > 0 and totals.runs_with_acks >= iterations // 2, f"seed={seed}: too few writes: {totals}"
    return totals


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_sigkill_at_random_moments_loses_no_acknowledged_block(tmp_path: Path, master: MasterKey) -> None:
    totals = await _crash_loop(tmp_path, master, ITERATIONS, drop_index=False)
    assert totals.kills == ITERATIONS


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_sigkill_with_index_deleted_rebuilds_every_acknowledged_block(tmp_path: Path, master: MasterKey) -> None:
    totals = await _crash_loop(tmp_path, master, REBUILD_ITERATIONS, drop_index=True)
    assert totals.index_deleted >= REBUILD_ITERATIONS // 3
    assert totals.index_rebuilt >= 1, f"no reopen rebuilt the index: {totals}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash_at", ["header:3", "torn:4", "unsynced:4"])
async def test_sigkill_at_a_chosen_syscall(tmp_path: Path, master: MasterKey, crash_at: str) -> None:
    """The writer kills itself at an exact point (crash_writer.install_crash_point):

    header    right after creating a segment file, before its header is written
    torn      halfway through writing a batch (or a footer)
    unsynced  after writing a batch, before its fdatasync and index commit

    Recovery must leave no corruption behind (no half-created segment), cut a
    torn batch off, and replay a written but unindexed one; then a normal run
    goes on from there."""
    seed = os.urandom(6).hex()
    data_dir = tmp_path / "data"
    cfg = store_config(data_dir)
    ledger, totals = Ledger(), Totals()
    where = f"seed={seed} crash_at={crash_at}"
    out, err = tmp_path / "run0.out", tmp_path / "run0.err"
    proc = _spawn(data_dir, 0, seed, master, out, err, crash_at)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"{where}: writer exited with {proc.returncode}:\n{err.read_text()}"
    assert out.read_bytes().startswith(b"READY\n"), f"{where}: died before writing anything"
    _parse(out, ledger, totals)

    def headerless() -> list[Path]:
        return [p for p in (data_dir / "segments").rglob("*") if p.is_file() and p.stat().st_size < 4096]

    point = crash_at.split(":")[0]
    if point == "header":
        assert headerless(), f"{where}: the crash point was not hit"
    r = await _reopen_and_check(cfg, master, seed, ledger, totals, where)
    if point == "header":
        assert not headerless(), f"{where}: half-created segment files left behind: {headerless()}"
    elif point == "torn":
        assert r.truncated, f"{where}: the half-written batch was not cut off: {r.as_dict()}"
    else:
        assert r.records_replayed >= 1, f"{where}: the written, unindexed batch was not replayed: {r.as_dict()}"

    # A normal run on the recovered store, killed at a random moment.
    out, err = tmp_path / "run1.out", tmp_path / "run1.err"
    proc = _spawn(data_dir, 1, seed, master, out, err)
    try:
        await _wait_ready(proc, out, err, where)
        await asyncio.sleep(random.uniform(*KILL_DELAY_S))
    finally:
        proc.kill()
        proc.wait()
    assert _parse(out, ledger, totals) > 0, f"{where}: the run after recovery wrote nothing"
    await _reopen_and_check(cfg, master, seed, ledger, totals, where)
