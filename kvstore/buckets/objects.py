"""Objects as kvstore blocks: writing an upload's bytes, reading ranges back.

An object (or a multipart upload's part) is stored as blocks of the bucket's
tenant named ``s3~<uid>~<n>``: ``uid`` is fresh for every upload, so a block
is never rewritten in place, and an object replaced while it is being read
keeps its old blocks until the catalog no longer names them. Blocks are at
most :data:`OBJECT_BLOCK` bytes (or the store's ``max_block_size`` if
smaller); they share the tenant's encryption, compression, quota, TTL,
compaction, object tier and events with every other block.

The reserved prefix ``s3~`` is the gateway's: blocks under it that no object
or part names (left by a crash between storing the blocks and committing the
catalog) are removed when the gateway starts (:func:`sweep_orphans`), once
the catalog is in line with the gateway's records (:mod:`.recovery`), so a
block a record still names is never taken for an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable

from kvstore.buckets import records
from kvstore.buckets.catalog import Catalog, Extents
from kvstore.buckets.records import Record
from kvstore.engine.api import DirectExtent, Store
from kvstore.errors import KVStoreError
from kvstore.names import S3_DATA_PREFIX

log = logging.getLogger("kvstore.s3")

PREFIX = S3_DATA_PREFIX
OBJECT_BLOCK = 16 << 20
DELETE_AT_ONCE = 64


def new_uid() -> str:
    return secrets.token_hex(16)


def block_key(uid: str, n: int) -> str:
    return f"{PREFIX}{uid}~{n}"


async def store_blocks(
    store: Store,
    tenant: str,
    chunks: AsyncIterator[bytes],
    block_size: int,
    before_last: Callable[[], None] | None = None,
    record: Callable[[Extents], tuple[str, Record]] | None = None,
) -> Extents:
    """Store the bytes ``chunks`` yields as blocks of ``block_size``; their
    extents. ``before_last`` runs once the chunks end, before the last block
    is stored: an upload's checks (:meth:`UploadBody.finish`), which throw
    the whole upload away. ``record`` then gives, from the extents, the
    gateway record (key, record) that names them: it is written together
    with the last block (one group commit, not two in turn). On any failure
    the blocks stored and the record are deleted and the error raised."""
    uid = new_uid()
    extents: Extents = []
    buf = bytearray()
    written: str | None = None

    async def put(n: int) -> None:
        with memoryview(buf) as view:
            piece = bytes(view[:n])  # one copy: the block the store keeps until it is durable
        del buf[:n]
        key = block_key(uid, len(extents))
        await store.put(tenant, key, piece)
        extents.append((key, n))

    try:
        async for data in chunks:
            buf += data
            while len(buf) >= block_size:
                await put(block_size)
        if before_last is not None:
            before_last()
        final = [*extents, (block_key(uid, len(extents)), len(buf))] if buf else list(extents)
        jobs: list[Awaitable[None]] = []
        if buf:  # an empty object has no block
            jobs.append(put(len(buf)))
        if record is not None:
            written, rec = record(final)
            jobs.append(records.put(store, tenant, written, rec))
        failed = [r for r in await asyncio.gather(*jobs, return_exceptions=True) if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
    except BaseException:
        await delete_blocks(store, tenant, extents + ([(written, 0)] if written is not None else []))
        raise
    return extents


async def delete_blocks(store: Store, tenant: str, extents: Iterable[tuple[str, int]]) -> None:
    """Delete blocks no object names any more, several at a time (their
    tombstones share group commits); a failure is logged, not raised (the
    blocks are orphans the next start-up sweeps)."""
    keys = [key for key, _ in extents]
    for i in range(0, len(keys), DELETE_AT_ONCE):
        batch = keys[i : i + DELETE_AT_ONCE]
        for key, r in zip(
            batch, await asyncio.gather(*(store.delete(tenant, k) for k in batch), return_exceptions=True), strict=True
        ):
            if isinstance(r, KVStoreError):
                log.warning("could not delete block %s of tenant %s: %s", key, tenant, r.code)
            elif isinstance(r, BaseException):
                raise r


class Readers:
    """The blocks reads in flight are using. An object replaced or deleted
    while it is being read keeps its blocks until the last read of them ends
    (the catalog already names the new ones): a GET that started on a
    version finishes on it, whole. Everything runs on the gateway's event
    loop, so counts need no lock."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._held: dict[str, int] = {}
        self._doomed: dict[str, str] = {}  # block key -> tenant, to delete once no read holds it
        self._tasks: set[asyncio.Task[None]] = set()

    def hold(self, extents: Extents) -> Held:
        """Hold ``extents`` until the returned object's ``release``."""
        for key, _ in extents:
            self._held[key] = self._held.get(key, 0) + 1
        return Held(self, [k for k, _ in extents])

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            n = self._held[key] - 1
            if n:
                self._held[key] = n
                continue
            del self._held[key]
            tenant = self._doomed.pop(key, None)
            if tenant is not None:
                self._spawn(tenant, [(key, 0)])

    def _spawn(self, tenant: str, extents: Extents) -> None:
        task = asyncio.ensure_future(delete_blocks(self._store, tenant, extents))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def retire(self, tenant: str, extents: Extents) -> None:
        """Delete blocks no object names any more, now or, for those a read
        holds, when the last such read ends."""
        now: Extents = []
        for key, size in extents:
            if key in self._held:
                self._doomed[key] = tenant
            else:
                now.append((key, size))
        await delete_blocks(self._store, tenant, now)

    async def close(self) -> None:
        """Wait for the deletions under way (reads have ended by now)."""
        for key, tenant in list(self._doomed.items()):
            self._spawn(tenant, [(key, 0)])
        self._doomed.clear()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class Held:
    """Blocks held by one read; ``release`` once, when the read has ended."""

    def __init__(self, readers: Readers, keys: list[str]) -> None:
        self._readers = readers
        self._keys: list[str] | None = keys

    def release(self) -> None:
        if self._keys is not None:
            keys, self._keys = self._keys, None
            self._readers._release(keys)


async def blocks_present(store: Store, tenant: str, extents: Extents) -> bool:
    if not extents:
        return True
    return all(await store.present(tenant, [k for k, _ in extents]))


Piece = DirectExtent | bytearray | memoryview


def release(piece: Piece) -> None:
    """Let go of a piece :func:`read_range` gave (a direct extent holds its segment)."""
    if isinstance(piece, DirectExtent):
        piece.release()


async def read_range(store: Store, tenant: str, extents: Extents, start: int, end: int) -> AsyncGenerator[Piece, None]:
    """Bytes [start, end) of the object, block by block (NotFound if a block
    has gone: evicted, expired, deleted): a direct block in a local segment
    as a :class:`DirectExtent` (to send with sendfile; the caller releases
    it), others as bytes. The next block is read while the caller sends the
    one before."""
    spans: list[tuple[str, int, int]] = []
    pos = 0
    for key, length in extents:
        lo, hi = max(start, pos), min(end, pos + length)
        if lo < hi:
            spans.append((key, lo - pos, hi - pos))
        pos += length
        if pos >= end:
            break

    async def read(span: tuple[str, int, int]) -> Piece:
        key, lo, hi = span
        return await store.get_sendable(tenant, key, lo, hi)

    pending: asyncio.Task[Piece] | None = None
    try:
        for i, span in enumerate(spans):
            current = pending if pending is not None else asyncio.ensure_future(read(span))
            pending = asyncio.ensure_future(read(spans[i + 1])) if i + 1 < len(spans) else None
            yield await current
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, KVStoreError):
                release(await pending)


async def sweep_orphans(store: Store, catalog: Catalog) -> int:
    """Delete the blocks under ``s3~`` of every tenant with buckets that no
    object or part names; how many. Runs before the gateway serves."""
    by_tenant: dict[str, list[str]] = {}
    for b in await catalog.run(catalog.all_buckets):
        if store.incarnation(b.tenant) != b.incarnation:
            await catalog.run(catalog.forget_bucket, b.name)
            continue
        by_tenant.setdefault(b.tenant, []).append(b.name)
    removed = 0
    for tenant, names in by_tenant.items():
        used = await catalog.run(catalog.referenced, names)
        doomed = []
        # Keys come in byte order: start just below "s3~", stop past its range.
        async for key in store.iter_keys(tenant, start_after="s3}"):
            if not key.startswith(PREFIX):
                if key > PREFIX:
                    break
                continue
            if key not in used:
                doomed.append((key, 0))
        await delete_blocks(store, tenant, doomed)
        removed += len(doomed)
    if removed:
        log.info("removed %d orphaned S3 object blocks", removed)
    return removed
