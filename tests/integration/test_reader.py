"""A reader process's view of a store another process writes (multi-worker).

The reader runs in a spawned child process, as in the daemon: LMDB allows one
environment per process, shared across processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey, load_master_key
from kvstore.engine.store import Store
from kvstore.errors import ReadOnlyStore


async def _reader_checks(conn: Connection, config: StoreConfig, secret: bytes) -> list[str]:
    reader = await Store.open_reader(config, MasterKey(secret))
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    try:
        conn.send("open")
        t: dict[str, Any] = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        check(reader.authenticate(t["alice"]) == "alice", "alice's token")
        check(await reader.get("alice", "k") == b"written by the writer" * 100, "alice's block")
        check((await reader.lookup("alice", ["k", "x"])).present == [True, False], "lookup")
        check(reader.authenticate(t["carol"]) == "carol", "a tenant created after the reader opened")
        check(await reader.get("carol", "c") == b"carol's block" * 50, "its block (its new data key)")
        check(reader.authenticate(t["revoked"]) is None, "a revoked token")
        check(reader.authenticate(t["dave"]) is None, "a deleted tenant's token")
        check(reader.authenticate(t["after"]) == "after", "a tenant created under a rotated master key")
        check(await reader.get("after", "k") == b"v" * 100, "its block")
        for name, call in (
            ("put", reader.put("alice", "w", b"x")),
            ("delete", reader.delete("alice", "k")),
            ("create_tenant", reader.create_tenant("z")),
        ):
            try:
                await call
                failures.append(f"{name} on a reader did not raise")
            except ReadOnlyStore:
                pass
        check(await reader.get("alice", "k") == b"written by the writer" * 100, "alice's block after refused writes")
    finally:
        await reader.close()
    return failures


def reader_main(conn: Connection, config: StoreConfig, secret: bytes) -> None:
    conn.send(asyncio.run(_reader_checks(conn, config, secret)))


async def test_reader_sees_the_writers_changes(store: Store, master: MasterKey, tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=reader_main, args=(child, store.config, master.secret))
    proc.start()
    loop = asyncio.get_running_loop()
    try:
        assert await loop.run_in_executor(None, parent.recv) == "open"
        tokens: dict[str, str] = {}
        _, tokens["alice"] = await store.issue_token("alice")
        await store.put("alice", "k", b"written by the writer" * 100)
        await store.create_tenant("carol")
        _, tokens["carol"] = await store.issue_token("carol")
        await store.put("carol", "c", b"carol's block" * 50)
        tid, tokens["revoked"] = await store.issue_token("carol")
        await store.revoke_token("carol", tid)
        await store.create_tenant("dave")
        _, tokens["dave"] = await store.issue_token("dave")
        await store.delete_tenant("dave")
        new_file = tmp_path / "new.key"
        new_file.write_bytes(os.urandom(32))
        new_file.chmod(0o600)
        await store.rotate_master_key(load_master_key(new_file), str(new_file))
        await store.create_tenant("after")  # its data key is wrapped by the new master key only
        _, tokens["after"] = await store.issue_token("after")
        await store.put("after", "k", b"v" * 100)
        parent.send(tokens)
        failures = await loop.run_in_executor(None, parent.recv)
    finally:
        proc.join(60)
    assert failures == []
    assert proc.exitcode == 0
    # The hint names the key file; it never holds the key.
    hint = (store.config.data_dir / "master-key.path").read_bytes()
    assert hint == str(new_file).encode() and new_file.read_bytes() not in hint
