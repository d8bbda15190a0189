"""Reads through read plans on a daemon's unix socket (``unix:PATH`` endpoints).

One plan per owner (per ``max_batch_keys`` keys) says where each block's
bytes are and passes the segment files' descriptors; the blocks are then
read from the files here (kvstore_client/plans.py). A key the plan answers
absent is served (a miss); a key it cannot give (sealed and the daemon
decodes, in the object tier only, the plan failed, the file could not be
read) is left for HTTP. A block that fails its checksums ends its read: the
descriptor is the daemon's own file, so the bytes are corrupt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvstore_client.decoding import Decode, DecodePool
from kvstore_client.errors import BufferTooSmall, CorruptBlock, KVStoreClientError
from kvstore_client.exchange import Exchange
from kvstore_client.plans import Plan, PlanConnection, PlannedBlock
from kvstore_client.reads.base import LEFT, Left, Outcome, PlanReader, Served, planned, planned_miss
from kvstore_client.sharding import UNIX, Shards


class UnixPlanReader(PlanReader):
    def __init__(
        self,
        exchange: Exchange,
        shards: Shards,
        decoders: DecodePool,
        *,
        enabled: bool,
        decode: Decode,
        max_batch_keys: int,
    ) -> None:
        super().__init__(exchange, shards, decoders, enabled=enabled, decode=decode)
        self._max_batch_keys = max_batch_keys

    def connection(self, url: str) -> PlanConnection | None:
        """The read-plan connection of a ``unix:`` endpoint (None: plans off or TCP)."""
        ep = self._x.endpoints[url]
        if not self._enabled or not url.startswith(UNIX):
            return None
        if ep.plans is None:
            ep.plans = PlanConnection(url[len(UNIX) :], ep.token, self._x.timeout)
        return ep.plans

    async def read(self, keys: Sequence[str], bufs: Sequence[memoryview], todo: list[int]) -> Served:
        served: dict[int, Outcome] = {}
        left: list[int] = []
        for url, idx in self._shards.by_first_owner(keys, todo).items():
            conn = self.connection(url)
            if conn is None:
                left += idx
                continue
            for c in range(0, len(idx), self._max_batch_keys):
                left += await self._chunk(conn, keys, bufs, idx[c : c + self._max_batch_keys], served)
        return served, sorted(left)

    async def _chunk(
        self,
        conn: PlanConnection,
        keys: Sequence[str],
        bufs: Sequence[memoryview],
        idx: list[int],
        served: dict[int, Outcome],
    ) -> list[int]:
        """One plan of ``idx``'s keys, their reads, its release: the indices left."""
        left: list[int] = []
        if len(idx) == 1:  # get_into: plan, read and release in one hop to a thread
            i = idx[0]
            try:
                got = await asyncio.to_thread(self._plan_one, conn, keys[i], bufs[i])
            except KVStoreClientError as e:
                return self._plan_failed(e, idx)
            self._settle(i, keys[i], got, served, left)
        else:
            try:
                plan = await asyncio.to_thread(conn.plan, [keys[i] for i in idx])
            except KVStoreClientError as e:
                return self._plan_failed(e, idx)
            try:
                reads: list[tuple[int, PlannedBlock]] = []
                for i in idx:
                    sorted_ = self._sort(plan, keys[i], bufs[i])
                    if isinstance(sorted_, PlannedBlock):
                        reads.append((i, sorted_))
                    else:
                        self._settle(i, keys[i], sorted_, served, left)
                pool = self._decoders.get()
                done = await asyncio.gather(
                    *(asyncio.to_thread(PlanConnection.read_into, b, bufs[i], pool) for i, b in reads),
                    return_exceptions=True,
                )
                for (i, _), n in zip(reads, done, strict=True):
                    self._settle(i, keys[i], n, served, left)
            finally:
                await asyncio.to_thread(self._release, conn, plan)
        self._x.stats["plan_fallbacks"] += len(left)
        return left

    def _plan_one(self, conn: PlanConnection, key: str, mv: memoryview) -> Outcome | Left:
        """On a thread: ``key``'s plan, its read and the plan's release."""
        plan = conn.plan([key])
        try:
            sorted_ = self._sort(plan, key, mv)
            if not isinstance(sorted_, PlannedBlock):
                return sorted_
            try:
                return conn.read_into(sorted_, mv, self._decoders.get())
            except Exception as e:  # noqa: BLE001 - settled on the event loop, as a batch's reads are
                return e
        finally:
            self._release(conn, plan)

    def _sort(self, plan: Plan, key: str, mv: memoryview) -> PlannedBlock | Outcome | Left:
        """The block to read for ``key``, its outcome (a miss, a buffer too small), or LEFT."""
        try:
            block = planned(plan, key, mv, self._decode)
        except BufferTooSmall as e:
            return e
        if block is not None:
            return block
        return None if planned_miss(plan, key) else LEFT

    def _settle(self, i: int, key: str, got: Outcome | Left, served: dict[int, Outcome], left: list[int]) -> None:
        """Key ``i``'s outcome served, or ``i`` left for HTTP."""
        if isinstance(got, Left):
            left.append(i)
        elif isinstance(got, OSError):  # the file could not be read here: HTTP
            self._x.log.warning("kvstore read of %s from its segment failed, reading over HTTP: %s", key, got)
            left.append(i)
        elif isinstance(got, (BufferTooSmall, CorruptBlock)):
            served[i] = got
        elif isinstance(got, BaseException):
            raise got
        else:
            served[i] = got
            self._x.stats["plan_reads"] += 1

    def _plan_failed(self, e: KVStoreClientError, idx: list[int]) -> list[int]:
        self._x.log.warning("kvstore read plan failed, reading over HTTP: %s", e)
        self._x.stats["plan_fallbacks"] += len(idx)
        return idx

    def _release(self, conn: PlanConnection, plan: Plan) -> None:
        try:
            conn.release(plan.lease)
        except KVStoreClientError as e:  # it expires on its own
            self._x.log.warning("kvstore read plan release failed: %s", e)
