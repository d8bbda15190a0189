"""The write path of the store: puts and deletes.

A put is checked, serialized with other writes of its key (first write wins:
a second put of a key is a no-op; a delete waits for a put in flight on the
same key), counted against the tenant's admission (``admit_after``:
admission.py; a block not admitted raises NotAdmitted, nothing written),
admitted by local space and the tenant's quota, encoded (frames compressed
and sealed on the thread pool, in parallel for big blocks) and handed to
the tenant's appender, which answers once it is durable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.engine.crypto import RecordCipher
from kvstore.engine.record import EncodedRecord, assemble, encode_frame, frame_count, new_record_id, tombstone
from kvstore.engine.registry import Tenant
from kvstore.engine.store_core import StoreCore
from kvstore.engine.types import BlockInfo, Stored
from kvstore.errors import (
    BlockTooLarge,
    InvalidInput,
    NotAdmitted,
    StorageFull,
)
from kvstore.events.model import BlockMeta
from kvstore.names import validate_key

Data = bytes | bytearray | memoryview


class StoreWrites(StoreCore):
    def _check_data(self, data: Data) -> memoryview:
        view = memoryview(data).cast("B")
        if len(view) == 0:
            raise InvalidInput("block is empty; blocks are 1 byte or more")
        if len(view) > self.config.max_block_size:
            raise BlockTooLarge(f"block is {len(view)} bytes; the maximum is {self.config.max_block_size}")
        return view

    async def _encode(self, t: Tenant, key: str, data: memoryview) -> EncodedRecord:
        fs = self.config.frame_size_of(t.frame_size)
        n = len(data)
        nf = frame_count(n, fs)
        record_id = new_record_id()
        sealed = t.sealed
        kv = t.key_version if sealed else 0
        comp, level = t.compression, self.config.zstd_level

        def frames(lo: int, hi: int) -> list[tuple[Any, Any]]:
            cipher = None
            if sealed:
                cipher = RecordCipher(self._registry.data_key(t.name, kv), record_id, t.name, key, kv, nf, n)
            return [encode_frame(cipher, i, data[i * fs : (i + 1) * fs], comp, level) for i in range(lo, hi)]

        if nf <= 1 or (comp == "none" and not sealed):
            done = await self._run(frames, 0, nf)
        else:
            parts = await asyncio.gather(*(self._run(frames, i, i + 1) for i in range(nf)))
            done = [f for part in parts for f in part]
        return assemble(t.name, key, n, fs, done, record_id, kv, sealed, t.policy == "direct")

    async def put(self, tenant: str, key: str, data: Data, meta: BlockMeta | None = None) -> Stored:
        """Store ``data`` under ``key``: the block as stored, ``created``
        False when the key existed (nothing written; the first write wins).
        ``meta``: the engine's identity of the block (Kvstore-Block-Meta),
        indexed with it and told in its residency events.

        Returns once the write is durable under the configured policy. The
        caller must not change ``data`` until then. Raises NotAdmitted (a
        decision, not a failure: nothing written) for a new block its
        tenant's admission declines (admission.py).
        """
        t = self._tenant(tenant)
        validate_key(key)
        view = self._check_data(data)
        self._retention.check_block(t, len(view))
        claim = await self._serialize(tenant, key)
        try:
            existing = self._index.get(tenant, key)
            if existing is not None:
                self.metrics.inc("kvstore_puts_total", result="exists")
                self.access.touch(tenant, key)  # written again: it is still wanted
                return Stored(False, BlockInfo.of(key, existing))
            counted = self.admission.check(t, key, len(view))
            await self._residency.admit(len(view))
            record = await self._encode(t, key, view)
            ident = self._ident_blob(t, key, meta) if meta is not None else None
            async with self._retention.reserve(t, record.length):
                try:
                    entry = await self._appender(t).submit(record, ident)
                except StorageFull:
                    self._residency.filled()
                    raise
            self._residency.space.wrote(record.length)
            if counted:
                self.admission.stored(t, key, len(view))
            self._stored(tenant, "put", "local", [key], [len(view)], [meta or BlockMeta.of_key(key)])
            self.metrics.inc("kvstore_puts_total", result="created")
            self.metrics.inc("kvstore_bytes_in_total", len(view))
            assert entry is not None  # an unconditional write is always indexed
            return Stored(True, BlockInfo.of(key, entry))
        finally:
            self._release(tenant, key, claim)

    async def put_many(
        self, tenant: str, items: Iterable[tuple[str, Data]], metas: Sequence[BlockMeta | None] | None = None
    ) -> list[Stored | NotAdmitted]:
        """Put several blocks (``metas``: their engine identities, in order);
        they share group-commit batches. Fails as a whole on the first
        invalid item, before writing anything; a block its tenant's
        admission declines is its NotAdmitted, in its place."""
        self._tenant(tenant)
        checked = [(validate_key(k), self._check_data(d)) for k, d in items]
        ids = list(metas) if metas is not None else [None] * len(checked)
        if len(ids) != len(checked):
            raise ValueError(f"{len(checked)} items but {len(ids)} identities")

        async def one(key: str, data: memoryview, meta: BlockMeta | None) -> Stored | NotAdmitted:
            try:
                return await self.put(tenant, key, data, meta)
            except NotAdmitted as e:
                return e

        return list(await asyncio.gather(*(one(k, d, m) for (k, d), m in zip(checked, ids, strict=True))))

    async def delete(self, tenant: str, key: str) -> bool:
        """Delete ``key`` (a durable tombstone). False when it was absent."""
        t = self._tenant(tenant)
        validate_key(key)
        claim = await self._serialize(tenant, key)
        try:
            entry = self._index.get(tenant, key)
            if entry is None:
                return False
            metas = self._identities(tenant, [key])
            await self._appender(t).submit(tombstone(tenant, key, entry.segment_id), maintenance=True)
            self._removed(tenant, "deleted", [(key, entry)], metas)
            self.metrics.inc("kvstore_deletes_total")
            return True
        finally:
            self._release(tenant, key, claim)
