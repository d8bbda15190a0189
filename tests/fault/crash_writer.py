"""Child process of test_crash.py: write blocks as fast as possible until killed.

Usage::

    KVSTORE_TEST_MASTER_KEY=<64 hex digits> python crash_writer.py DATA_DIR RUN SEED

Opens a store on DATA_DIR (fsync durability, 1 MiB segments, 64 KiB frames),
creates the tenants of :data:`TENANTS` that are missing, prints ``READY``, then
runs rounds of :data:`CONCURRENCY` concurrent puts (and now and then a delete
of a block it wrote earlier in this run). After each write returns it prints
one line and flushes it, so every line names a write the store acknowledged::

    ACK <tenant> <key> <sha256 of the block>
    DEL <tenant> <key>

and before it starts a delete, ``DELETING <tenant> <key>`` (a kill may land
after the tombstone is durable but before ``DEL`` is printed).

With KVSTORE_TEST_CRASH_AT=POINT:N it kills itself at a chosen syscall
instead (:func:`install_crash_point`).

Keys are ``r<RUN>-<n>``, unique across runs; a block's content is a function
of SEED and its key alone (:func:`block_content`), so the parent can check any
block it finds, acknowledged or not.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvstore.config import StoreConfig  # noqa: E402
from kvstore.engine.crypto import MasterKey  # noqa: E402
from kvstore.engine.store import Store  # noqa: E402

MASTER_ENV = "KVSTORE_TEST_MASTER_KEY"
CRASH_ENV = "KVSTORE_TEST_CRASH_AT"
CRASH_POINTS = ("header", "torn", "unsynced")
TENANTS: tuple[tuple[str, str], ...] = (("sealed", "sealed"), ("direct", "direct"))
CONCURRENCY = 8
MAX_BLOCK = 300 * 1024
MAX_RUNTIME_S = 60.0  # a safety net: the parent kills us long before this
KV_DIR = ROOT / "bench" / "data" / "kv"


def store_config(data_dir: str | os.PathLike[str]) -> StoreConfig:
    return StoreConfig.from_env(data_dir, env={}, segment_size="1MiB", frame_size="64KiB", durability="fsync")


@functools.cache
def _samples() -> tuple[bytes, ...]:
    return tuple(p.read_bytes() for p in sorted(KV_DIR.glob("*.bin")))


def block_content(seed: str, key: str) -> bytes:
    """The block stored under ``key``: 1 B to 300 KiB, a slice of a real KV
    cache (compressible) or random bytes (not), fixed by ``seed`` and ``key``."""
    rng = random.Random(hashlib.sha256(f"{seed}/{key}".encode()).digest())
    r = rng.random()
    if r < 0.35:
        size = rng.randint(1, 4096)
    elif r < 0.65:
        size = rng.randint(4097, 64 * 1024)
    else:  # 2 to 5 frames of 64 KiB
        size = rng.randint(64 * 1024 + 1, MAX_BLOCK)
    samples = _samples()
    if samples and rng.random() < 0.5:
        sample = samples[rng.randrange(len(samples))]
        start = rng.randrange(len(sample) - size)
        return sample[start : start + size]
    return rng.randbytes(size)


def install_crash_point(spec: str) -> None:
    """Die by SIGKILL at a chosen syscall on a segment file, ``POINT:N``:

    ``header:N``   the Nth write of a segment header (the file was just created)
    ``torn:N``     the Nth write of records or a footer: write half of it, then die
    ``unsynced:N`` the Nth fdatasync of a batch or footer, instead of it (written, not synced or indexed)
    """
    point, _, nth = spec.partition(":")
    if point not in CRASH_POINTS or not nth.isdigit():
        raise SystemExit(f"{CRASH_ENV}={spec!r}: expected one of {CRASH_POINTS} and :N")
    left = [int(nth)]
    lock = threading.Lock()
    real_pwritev, real_fdatasync = os.pwritev, os.fdatasync

    def hit(fd: int, kind: str) -> bool:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if kind != point or "/segments/" not in path or (kind == "unsynced" and not path.endswith(".seg")):
            return False
        with lock:
            left[0] -= 1
            return left[0] == 0

    def pwritev(fd: int, buffers: Sequence[Any], offset: int, *flags: int) -> int:
        if hit(fd, "header" if offset == 0 else "torn"):
            if point == "torn":
                views = [memoryview(b).cast("B") for b in buffers]
                half = sum(len(v) for v in views) // 2 | 1  # odd: never on a record boundary
                # through a page-cache descriptor of the same file: an O_DIRECT one refuses odd lengths
                torn = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
                real_pwritev(torn, [bytes(b"".join(views))[:half]], offset)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_pwritev(fd, buffers, offset, *flags)

    def fdatasync(fd: int) -> None:
        if hit(fd, "unsynced"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_fdatasync(fd)

    # segment.py looks them up on the os module at call time (typeshed's signatures are wider).
    os.pwritev = pwritev  # type: ignore[assignment]
    os.fdatasync = fdatasync  # type: ignore[assignment]


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _put(store: Store, seed: str, tenant: str, key: str) -> None:
    data = block_content(seed, key)
    if not (await store.put(tenant, key, data)).created:
        raise AssertionError(f"put of new key {key!r} reported that the key exists")
    _say(f"ACK {tenant} {key} {hashlib.sha256(data).hexdigest()}")


async def _delete(store: Store, tenant: str, key: str) -> None:
    _say(f"DELETING {tenant} {key}")  # from now on the block may be gone, acknowledged or not
    if not await store.delete(tenant, key):
        raise AssertionError(f"delete of {tenant}/{key} found no block")
    _say(f"DEL {tenant} {key}")


async def run(data_dir: str, run_id: int, seed: str) -> None:
    master = MasterKey(bytes.fromhex(os.environ[MASTER_ENV]))
    store = await Store.open(store_config(data_dir), master)
    existing = {t["name"] for t in store.tenants()}
    for name, policy in TENANTS:
        if name not in existing:
            await store.create_tenant(name, policy)
    _say("READY")
    rng = random.Random(f"{seed}/run{run_id}")
    written: list[tuple[str, str]] = []
    n = 0
    deadline = time.monotonic() + MAX_RUNTIME_S
    while time.monotonic() < deadline:
        ops = []
        batch = []
        for _ in range(CONCURRENCY):
            tenant = TENANTS[rng.randrange(len(TENANTS))][0]
            key = f"r{run_id:03d}-{n:06d}"
            n += 1
            batch.append((tenant, key))
            ops.append(_put(store, seed, tenant, key))
        if written and rng.random() < 0.25:
            ops.append(_delete(store, *written.pop(rng.randrange(len(written)))))
        await asyncio.gather(*ops)
        written.extend(batch)
    await store.close()
    sys.exit(3)  # never killed: the parent treats this as a failure


def main() -> None:
    data_dir, run_id, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if os.environ.get(CRASH_ENV):
        install_crash_point(os.environ[CRASH_ENV])
    asyncio.run(run(data_dir, run_id, seed))


if __name__ == "__main__":
    main()
