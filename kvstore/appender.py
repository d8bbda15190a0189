"""Group commit: one appender per tenant drains a queue of encoded records.

Each batch is written with one ``pwritev``, synced once (``fsync`` policy),
then its index entries are committed in one LMDB transaction, and only then
are its callers acknowledged. On any failure (ENOSPC, EIO on write or sync, an
index error) the segment is truncated back to where the batch began and the
whole batch fails: nothing acknowledged is ever lost, nothing half-written is
ever indexed. Under the ``interval`` policy, batches are acknowledged after
the index commit and synced by the same worker every ``sync_interval_ms``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError, StorageFull, StorageIOError, StoreClosed
from kvstore.format import ALIGN, FooterEntry
from kvstore.index import SEG_OPEN, SEG_SEALED, Index, IndexEntry, SegmentState
from kvstore.metrics import Metrics
from kvstore.record import EncodedRecord, footer_entry, index_entry
from kvstore.segment import SegmentFile

log = logging.getLogger("kvstore.appender")


@dataclass(slots=True)
class OpenSegment:
    """The appendable tail of a tenant: its open segment (if any) and footer so far."""

    segment: SegmentFile | None
    footer: list[FooterEntry] = field(default_factory=list)
    next_id: int = 1
    synced_upto: int = ALIGN


@dataclass(slots=True)
class _Item:
    record: EncodedRecord
    future: asyncio.Future[IndexEntry | None]


class Appender:
    def __init__(
        self,
        tenant: str,
        directory: Path,
        direct: bool,
        tail: OpenSegment,
        index: Index,
        config: StoreConfig,
        executor: Executor,
        metrics: Metrics,
        on_segment: Callable[[SegmentFile], None],
        on_sealed: Callable[[int], None] | None = None,
    ) -> None:
        self.tenant = tenant
        self._dir = directory
        self._direct = direct
        self._tail = tail
        self._index = index
        self._cfg = config
        self._executor = executor
        self._metrics = metrics
        self._on_segment = on_segment
        self._on_sealed = on_sealed
        self._queue: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._dirty = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"appender:{tenant}")

    # -- public ---------------------------------------------------------------

    async def submit(self, record: EncodedRecord) -> IndexEntry | None:
        """Append ``record``; return once it is durable under the policy and indexed."""
        if self._closing:
            raise StoreClosed(f"tenant {self.tenant!r} is closing; no more writes")
        fut: asyncio.Future[IndexEntry | None] = asyncio.get_running_loop().create_future()
        self._queue.append(_Item(record, fut))
        self._wake.set()
        return await fut

    async def seal(self) -> None:
        """Seal the open segment now (no-op when it holds no records)."""
        await self._call(self._seal_current)

    async def close(self) -> None:
        """Finish every queued write, sync, and stop. The segment stays open on disk."""
        self._closing = True
        self._wake.set()
        await self._task
        await self._call(self._interval_sync)

    # -- the worker -----------------------------------------------------------

    async def _call(self, fn: Callable[[], object]) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _run(self) -> None:
        interval = self._cfg.sync_interval_ms / 1000
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                if self._cfg.durability == "interval" and self._dirty:
                    try:
                        await asyncio.wait_for(self._wake.wait(), interval)
                    except TimeoutError:
                        await self._sync_in_background()
                    continue
                await self._wake.wait()
                continue
            batch = self._take_batch()
            try:
                entries = await asyncio.get_running_loop().run_in_executor(self._executor, self._write_batch, batch)
            except KVStoreError as e:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            except BaseException as e:
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(StorageIOError(f"batch write failed: {e!r}"))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for item, entry in zip(batch, entries, strict=True):
                if not item.future.done():
                    item.future.set_result(entry)

    def _take_batch(self) -> list[_Item]:
        batch = [self._queue.popleft()]
        size = batch[0].record.length
        while self._queue and size + self._queue[0].record.length <= self._cfg.max_batch_bytes:
            item = self._queue.popleft()
            size += item.record.length
            batch.append(item)
        return batch

    async def _sync_in_background(self) -> None:
        try:
            await self._call(self._interval_sync)
        except (OSError, KVStoreError) as e:
            log.error("periodic sync of tenant %s failed: %s", self.tenant, e)

    # -- executor side --------------------------------------------------------

    def _segment_for(self, nbytes: int) -> SegmentFile:
        seg = self._tail.segment
        if seg is not None and seg.size > ALIGN and seg.size + nbytes > self._cfg.segment_size:
            self._seal_current()
            seg = None
        if seg is None:
            seg = SegmentFile.create(self._dir, self.tenant, self._tail.next_id, self._direct)
            self._tail.next_id += 1
            self._tail.segment = seg
            self._tail.footer = []
            self._tail.synced_upto = seg.size
            self._index.set_segment(self.tenant, seg.segment_id, SegmentState(SEG_OPEN, seg.size, seg.size))
            self._on_segment(seg)
            self._metrics.inc("kvstore_segments_created_total")
        return seg

    def _write_batch(self, batch: list[_Item]) -> list[IndexEntry | None]:
        nbytes = sum(item.record.length for item in batch)
        try:
            seg = self._segment_for(nbytes)
        except OSError as e:
            raise _io_error(e, "sealing the full segment or creating the next one") from None
        start = seg.size
        buffers = [b for item in batch for b in item.record.buffers]
        fsync = self._cfg.durability == "fsync"
        try:
            seg.append(buffers)
            if fsync:
                t0 = time.perf_counter()
                seg.sync()
                self._metrics.observe("kvstore_fsync_seconds", time.perf_counter() - t0)
                self._tail.synced_upto = seg.size
            footer, ops = [], []
            pos = start
            for item in batch:
                fe = footer_entry(pos, item.record.header)
                footer.append(fe)
                ops.append((fe.key, index_entry(seg.segment_id, fe)))
                pos += item.record.length
            self._index.apply(
                self.tenant, ops, seg.segment_id, SegmentState(SEG_OPEN, seg.size, self._tail.synced_upto)
            )
        except Exception as e:  # noqa: BLE001 - any failure (OSError, LMDB) must undo the batch
            self._undo(seg, start)
            if isinstance(e, OSError):
                raise _io_error(e, f"writing a batch of {len(batch)} records to {seg.name}") from None
            raise StorageIOError(f"index commit failed for a batch on {seg.name}: {e}") from None
        self._tail.footer.extend(footer)
        self._dirty = not fsync
        self._metrics.observe("kvstore_batch_records", len(batch))
        self._metrics.inc("kvstore_bytes_written_total", nbytes)
        return [op[1] for op in ops]

    def _undo(self, seg: SegmentFile, start: int) -> None:
        """Cut the failed batch off; if even that fails, abandon the segment."""
        try:
            seg.truncate(start)
            seg.sync()
        except OSError as e:
            # Keep the fd: readers share it for the records before ``start``.
            # Recovery cuts this segment back to its indexed_upto and seals it.
            log.error("could not truncate %s back to %d (%s); abandoning it", seg.name, start, e)
            self._tail.segment = None

    def _interval_sync(self) -> None:
        seg = self._tail.segment
        if seg is None or not self._dirty:
            return
        t0 = time.perf_counter()
        seg.sync()
        self._metrics.observe("kvstore_fsync_seconds", time.perf_counter() - t0)
        self._tail.synced_upto = seg.size
        self._index.set_segment(self.tenant, seg.segment_id, SegmentState(SEG_OPEN, seg.size, seg.size))
        self._dirty = False

    def _seal_current(self) -> None:
        seg = self._tail.segment
        if seg is None or seg.size <= ALIGN:
            return
        end = seg.size
        seg.seal(self._tail.footer)
        self._index.set_segment(self.tenant, seg.segment_id, SegmentState(SEG_SEALED, end, end))
        self._tail.segment = None
        self._tail.footer = []
        self._dirty = False
        self._metrics.inc("kvstore_segments_sealed_total")
        if self._on_sealed is not None:
            self._on_sealed(seg.segment_id)


def _io_error(e: OSError, doing: str) -> KVStoreError:
    if e.errno == errno.ENOSPC:
        return StorageFull(f"no space left on device while {doing}")
    return StorageIOError(f"I/O error while {doing}: {e.strerror or e}")
