"""Group commit: one appender per tenant owns the tenant's open segment and
every change to the tenant's index entries.

Everything that changes a tenant's open segment or its block entries goes
through its appender's queue, in order: puts and tombstones, records copied
by compaction, entries dropped by eviction, quota or expiry, and seals (a
flush, a seal by age (``seal_after_s``) or a stop asks the appender; none
touches the file itself). The appender's task runs one step at a time on
the executor, so no two of these ever run at once on the same segment or
interleave inside a batch.

Each batch of records is written with one ``pwritev`` (``O_DIRECT`` where
the filesystem takes it and ``direct_io`` is not off: directio.py), synced
once (``fsync`` policy), then its index entries are committed in one LMDB transaction, and
only then are its callers acknowledged. On any failure (ENOSPC, EIO on write
or sync, an index error) the segment is truncated back to where the batch
began and the whole batch fails: nothing acknowledged is ever lost, nothing
half-written is ever indexed.

Writes are of two classes, never mixed in one batch: puts, and *maintenance*
(tombstones of deletes and removals, compaction's copies, seals). A
maintenance batch or step that finds the disk full releases the space
reserve (reserve.py) and is tried once more, so removals and compaction
make progress on a disk that puts have filled; a put batch is refused
(``507 storage_full``). Under the ``interval`` policy, batches are
acknowledged after the index commit and synced (segment and index) by the
same task every ``sync_interval_ms``.

A write plan (write_plan.py) takes space here in two steps: :meth:`reserve`
allocates room for its records at the end of the open segment and marks it
with pad records; :meth:`commit` writes a record's header over its pad once
the client has written the payload, syncs, and indexes it, in order with
everything else. A segment with reservations still open is not sealed: a
flush or a full segment sets it aside (*draining*), appends go to a new
segment, and the drained one is sealed when its last reservation ends.
While a key has a reservation, compaction may not move a tombstone of it
(KeyReserved): the block's record sits before that copy in the file, and a
replay in file order must not delete what the commit indexed after it.

A copied record (compaction) is conditional: it is written only if the key's
entry still points at the record it copies, taking into account the ops
before it in the same batch; otherwise it is skipped (the block was deleted,
replaced or evicted meanwhile) and its caller gets None. A removal (quota,
TTL) is a conditional tombstone in the same way: written only if the key
still points at the record chosen, so a removal is as durable as a delete
and an index rebuild never brings the block back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import StoreConfig
from kvstore.engine import directio
from kvstore.engine.format import ALIGN, FooterEntry, RecordHeader, decode_footer, encode_footer
from kvstore.engine.index import Index, IndexEntry
from kvstore.engine.lifecycle import Lifecycle
from kvstore.engine.record import EncodedRecord, footer_entry, index_entry, pad, tombstone
from kvstore.engine.reserve import SpaceReserve
from kvstore.engine.segment import SegmentFile
from kvstore.errors import KeyReserved, KVStoreError, StorageFull, StorageIOError, StoreClosed
from kvstore.metrics import Metrics
from kvstore.tasks import wait_event

log = logging.getLogger("kvstore.engine.appender")


@dataclass(slots=True)
class OpenSegment:
    """The appendable tail of a tenant: its open segment (if any) and footer so far."""

    segment: SegmentFile | None
    next_id: int = 1
    synced_upto: int = ALIGN
    # time.monotonic() when the open segment took its first record not yet
    # sealed (None: nothing unsealed): the age seal_after_s is measured by
    # (store_maintenance.seal_aged). Written by the appender's executor
    # thread, read on the loop: one attribute, a moment stale at worst.
    unsealed_since: float | None = None
    _footer: list[FooterEntry] | None = field(default=None, repr=False)
    # The footer as a clean stop wrote it (encoded, entries): decoded on first use, so that a
    # start with many tenants decodes none it does not write to (tails.py).
    _stopped: tuple[bytes, int] | None = field(default=None, repr=False)

    @property
    def footer(self) -> list[FooterEntry]:
        """The open segment's footer so far (its records in write order)."""
        if self._footer is None:
            self._footer = decode_footer(*self._stopped) if self._stopped is not None else []
            self._stopped = None
        return self._footer

    @footer.setter
    def footer(self, entries: list[FooterEntry]) -> None:
        self._footer, self._stopped = entries, None

    def stopped_footer(self, encoded: bytes, entries: int) -> None:
        """Take the footer a clean stop left, encoded (decoded on first use)."""
        self._footer, self._stopped = None, (encoded, entries)

    def encoded_footer(self) -> tuple[bytes, int]:
        """The footer encoded, and its entries (as it came, if never decoded)."""
        if self._stopped is not None:
            return self._stopped
        footer = self.footer
        return encode_footer(footer), len(footer)


@dataclass(slots=True)
class Reservation:
    """Space a write plan holds for one record: ``header`` (its checksums
    still zero) at ``offset`` of ``segment``."""

    segment: SegmentFile
    offset: int
    header: RecordHeader
    direct: bool = False  # the segment's records are written with O_DIRECT (the client writes so too)

    @property
    def payload_at(self) -> int:
        """Where the client writes the block's bytes."""
        return self.offset + self.header.payload_offset


@dataclass(slots=True)
class _Draining:
    """A segment set aside with reservations still open; sealed when they end."""

    segment: SegmentFile
    footer: list[FooterEntry]


_RESERVED: tuple[bool, IndexEntry | None] = (False, None)  # a copy left for later: the key is reserved


@dataclass(slots=True)
class _Write:
    """A record to append. ``copy``: written only if the key's entry is still
    ``expect`` (None: the key is absent, for a copied tombstone)."""

    record: EncodedRecord
    future: asyncio.Future[tuple[bool, IndexEntry | None]] | None  # (written, its entry); None: inside a step
    copy: bool = False
    expect: IndexEntry | None = None
    ident: bytes | None = None  # the block's engine identity, indexed with its entry
    maintenance: bool = False  # a tombstone or a compaction copy: may use the space reserve


@dataclass(slots=True)
class _Step:
    """Anything else the appender does in order with its writes."""

    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    maintenance: bool = False


class Appender:
    def __init__(
        self,
        tenant: str,
        directory: Path,
        direct: bool,
        tail: OpenSegment,
        index: Index,
        lifecycle: Lifecycle,
        config: StoreConfig,
        executor: Executor,
        metrics: Metrics,
        on_segment: Callable[[SegmentFile], None],
        on_sealed: Callable[[int], None] | None = None,
        reserve: SpaceReserve | None = None,
    ) -> None:
        self.tenant = tenant
        self._dir = directory
        self._direct = direct
        self._tail = tail
        self._index = index
        self._life = lifecycle
        self._cfg = config
        self._executor = executor
        self._metrics = metrics
        self._on_segment = on_segment
        self._on_sealed = on_sealed
        self._reserve = reserve
        self._direct_io: bool | None = None if config.direct_io != "off" else False  # None: not asked yet
        self._queue: deque[_Write | _Step] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._dirty = False
        self._pending: dict[int, int] = {}  # segment id -> open reservations in it
        self._draining: dict[int, _Draining] = {}
        self._reserved: set[str] = set()  # keys with an open reservation
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"appender:{tenant}")

    # -- public ---------------------------------------------------------------

    async def submit(
        self, record: EncodedRecord, ident: bytes | None = None, maintenance: bool = False
    ) -> IndexEntry | None:
        """Append ``record``; return once it is durable under the policy and
        indexed (with ``ident``, the block's engine identity, if given).
        ``maintenance``: a tombstone, which may use the space reserve."""
        fut: asyncio.Future[tuple[bool, IndexEntry | None]] = self._future()
        self._queue.append(_Write(record, fut, ident=ident, maintenance=maintenance))
        self._wake.set()
        return (await fut)[1]

    async def copy(self, record: EncodedRecord, expect: IndexEntry | None) -> bool:
        """Append a record copied as it is (compaction), if the key's entry is
        still ``expect`` when its batch is written (None: the key is absent,
        for a tombstone); False when it was skipped."""
        fut: asyncio.Future[tuple[bool, IndexEntry | None]] = self._future()
        self._queue.append(_Write(record, fut, copy=True, expect=expect, maintenance=True))
        self._wake.set()
        return (await fut)[0]

    async def seal(self) -> int | None:
        """Seal the open segment now, in order with the writes queued before
        this call. Returns the sealed segment's id (None: nothing to seal)."""
        result: int | None = await self.step(self._seal_current, maintenance=True)
        return result

    async def remove(
        self,
        victims: Sequence[tuple[str, IndexEntry]],
        spare: Callable[[Sequence[str]], AbstractContextManager[Sequence[str]]] | None = None,
    ) -> list[str]:
        """Remove the blocks of ``victims`` (key, the entry chosen) that still
        are what the index holds, each with a durable tombstone (as a delete:
        neither a restart nor an index rebuild brings them back); returns the
        keys removed. ``spare``: a guard that gives the keys that may go now
        and is held until they are gone (the locks of lookups, lifecycle.Leases.sparing)."""

        def remove() -> list[str]:
            with spare([k for k, _ in victims]) if spare is not None else _all([k for k, _ in victims]) as allowed:
                doomed = set(allowed)
                writes = [
                    _Write(tombstone(self.tenant, k, e.segment_id), None, copy=True, expect=e, maintenance=True)
                    for k, e in victims
                    if k in doomed
                ]
                done = self._write_batch(writes) if writes else []
                return [w.record.header.key for w, (written, _) in zip(writes, done, strict=True) if written]

        removed: list[str] = await self.step(remove, maintenance=True)
        return removed

    async def drop(self, victims: Sequence[tuple[str, IndexEntry]]) -> list[str]:
        """Remove the entries of ``victims`` (key, the entry expected) that are
        still what the index holds, without a record; returns the keys
        removed. Only for entries into a segment whose file goes next (an
        ephemeral segment dropped under disk pressure, tiering.py): nothing
        is left for an index rebuild to find."""
        removed: list[str] = await self.step(
            lambda: self._index.drop_if_current(self.tenant, victims), maintenance=True
        )
        return removed

    async def make_durable(self) -> None:
        """Everything written before this call is synced, segment and index,
        whatever the durability policy (compaction needs it before it retires
        what it copied)."""

        def sync() -> None:
            self._interval_sync()
            self._index.sync()

        await self.step(sync)

    async def step(self, fn: Callable[[], Any], maintenance: bool = False) -> Any:
        """Run ``fn`` on the executor in order with the writes (blocking I/O).
        ``maintenance``: if it finds the disk full, the space reserve is
        released and it runs once more."""
        fut: asyncio.Future[Any] = self._future()
        self._queue.append(_Step(fn, fut, maintenance))
        self._wake.set()
        return await fut

    async def reserve(self, headers: Sequence[RecordHeader]) -> list[Reservation]:
        """Room for records of these shapes, one after another at the end of
        the open segment, allocated on disk and marked with pads; each is
        committed or abandoned later. Their keys are reserved until then."""
        out: list[Reservation] = await self.step(functools.partial(self._reserve_space, list(headers)))
        return out

    async def commit(self, items: Sequence[tuple[Reservation, RecordHeader, bytes | None]]) -> list[IndexEntry | None]:
        """Write each reservation's final header (with the checksums of the
        bytes the client wrote: checked by the caller) over its pad, sync
        under the policy, and index them (with the engine identity, if
        any); None for a key that exists meanwhile (its pad stays). The
        reservations end, committed or not."""
        out: list[IndexEntry | None] = await self.step(functools.partial(self._commit, list(items)))
        return out

    async def abandon(self, reservations: Sequence[Reservation]) -> None:
        """End reservations that will not be committed: their pads stay, dead
        space for compaction."""
        await self.step(functools.partial(self._end, list(reservations)))

    async def close(self) -> None:
        """Finish every queued write, sync, and stop. The segment stays open
        on disk; segments set aside for reservations are sealed."""
        self._closing = True
        self._wake.set()
        await self._task
        await self._call(self._interval_sync)
        if self._draining:
            self._pending.clear()
            self._reserved.clear()
            await self._call(self._seal_drained)

    @property
    def open_segment(self) -> int | None:
        seg = self._tail.segment
        return seg.segment_id if seg is not None else None

    # -- the worker -----------------------------------------------------------

    def _future(self) -> asyncio.Future[Any]:
        if self._closing:
            raise StoreClosed(f"tenant {self.tenant!r} is closing; no more writes")
        return asyncio.get_running_loop().create_future()

    async def _call(self, fn: Callable[[], object]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _run(self) -> None:
        interval = self._cfg.sync_interval_ms / 1000
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                if self._cfg.durability == "interval" and self._dirty:
                    if not await wait_event(self._wake, interval):
                        await self._sync_in_background()
                    continue
                await self._wake.wait()
                continue
            head = self._queue[0]
            if isinstance(head, _Step):
                self._queue.popleft()
                await self._run_step(head)
                continue
            batch = self._take_batch()
            write = functools.partial(self._write_batch, batch)
            try:
                entries = await self._call(functools.partial(self._spending, write) if batch[0].maintenance else write)
            except KVStoreError as e:
                _fail(batch, e)
                continue
            except BaseException as e:
                _fail(batch, StorageIOError(f"batch write failed: {e!r}"))
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for item, entry in zip(batch, entries, strict=True):
                if item.future is not None and not item.future.done():
                    if entry is _RESERVED:
                        item.future.set_exception(
                            KeyReserved(f"key {item.record.header.key!r} has a write plan open; copy it later")
                        )
                    else:
                        item.future.set_result(entry)

    async def _run_step(self, step: _Step) -> None:
        try:
            result = await self._call(functools.partial(self._spending, step.fn) if step.maintenance else step.fn)
        except BaseException as e:
            if not step.future.done():
                step.future.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        if not step.future.done():
            step.future.set_result(result)

    def _take_batch(self) -> list[_Write]:
        first = self._queue.popleft()
        assert isinstance(first, _Write)
        batch = [first]
        size = first.record.length
        while self._queue:
            nxt = self._queue[0]
            if (
                not isinstance(nxt, _Write)
                or nxt.maintenance != first.maintenance
                or size + nxt.record.length > self._cfg.max_batch_bytes
            ):
                break
            self._queue.popleft()
            size += nxt.record.length
            batch.append(nxt)
        return batch

    async def _sync_in_background(self) -> None:
        try:
            await self._call(self._interval_sync)
        except (OSError, KVStoreError) as e:
            log.error("periodic sync of tenant %s failed: %s", self.tenant, e)

    # -- executor side --------------------------------------------------------

    def _spending(self, fn: Callable[[], Any]) -> Any:
        """Run maintenance ``fn``; on a full disk, with the space reserve released."""
        return fn() if self._reserve is None else self._reserve.spending(fn)

    def _segment_for(self, nbytes: int) -> SegmentFile:
        seg = self._tail.segment
        if seg is not None and seg.size > ALIGN and seg.size + nbytes > self._cfg.segment_size:
            self._seal_current()
            seg = self._tail.segment  # None now (sealed, or set aside for its reservations)
        if seg is None:
            seg = SegmentFile.create(self._dir, self.tenant, self._tail.next_id, self._direct)
            self._tail.next_id += 1
            self._tail.segment = seg
            self._tail.footer = []
            self._tail.synced_upto = seg.size
            self._life.opened(self.tenant, seg.segment_id, seg.size)
            self._on_segment(seg)
            self._metrics.inc("kvstore_segments_created_total")
        return seg

    def _current(self, batch: list[_Write]) -> list[_Write]:
        """The writes of ``batch`` to make: copies whose block is no longer
        where they copy it from are left out (their caller gets None)."""
        touched: set[str] = set()
        out: list[_Write] = []
        for item in batch:
            key = item.record.header.key
            if item.copy and (
                key in touched or key in self._reserved or self._index.get(self.tenant, key) != item.expect
            ):
                continue
            touched.add(key)
            out.append(item)
        return out

    def _write_batch(self, batch: list[_Write]) -> list[tuple[bool, IndexEntry | None]]:
        todo = self._current(batch)
        if not todo:
            return [self._skipped(item) for item in batch]
        nbytes = sum(item.record.length for item in todo)
        try:
            seg = self._segment_for(nbytes)
        except OSError as e:
            raise _io_error(e, "sealing the full segment or creating the next one") from None
        if self._direct_io is None:
            self._direct_io = directio.supported(self._dir)
        if self._direct_io:
            seg.use_direct_io()
        start = seg.size
        buffers = [b for item in todo for b in item.record.buffers]
        fsync = self._cfg.durability == "fsync"
        try:
            seg.append(buffers)
            if fsync:
                t0 = time.perf_counter()
                seg.sync()
                self._metrics.observe("kvstore_fsync_seconds", time.perf_counter() - t0)
                self._tail.synced_upto = seg.size
            footer, ops, idents = [], [], {}
            pos = start
            for item in todo:
                fe = footer_entry(pos, item.record.header)
                footer.append(fe)
                ops.append((fe.key, index_entry(seg.segment_id, fe)))
                if item.ident is not None:
                    idents[fe.key] = item.ident
                pos += item.record.length
            self._life.appended(self.tenant, seg.segment_id, ops, seg.size, self._tail.synced_upto, idents)
        except Exception as e:  # noqa: BLE001 - any failure (OSError, LMDB) must undo the batch
            self._undo(seg, start)
            raise _batch_error(e, f"writing a batch of {len(todo)} records to {seg.name}") from None
        self._tail.footer.extend(footer)
        self._dirty = not fsync
        self._unsealed()
        self._metrics.observe("kvstore_batch_records", len(todo))
        self._metrics.inc("kvstore_bytes_written_total", nbytes)
        written = {id(item): op[1] for item, op in zip(todo, ops, strict=True)}
        return [(True, written[id(item)]) if id(item) in written else self._skipped(item) for item in batch]

    def _skipped(self, item: _Write) -> tuple[bool, IndexEntry | None]:
        """A copy not made: the block moved on, or (_RESERVED) its key is reserved."""
        return _RESERVED if item.copy and item.record.header.key in self._reserved else (False, None)

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
            self._tail.unsealed_since = None

    def _interval_sync(self) -> None:
        seg = self._tail.segment
        if seg is None or not self._dirty:
            return
        t0 = time.perf_counter()
        seg.sync()
        self._metrics.observe("kvstore_fsync_seconds", time.perf_counter() - t0)
        self._tail.synced_upto = seg.size
        self._life.synced(self.tenant, seg.segment_id, seg.size)
        self._index.sync()  # under "interval" the index is synced here, not per commit
        self._dirty = False

    def _seal_current(self) -> int | None:
        seg = self._tail.segment
        if seg is None or seg.size <= ALIGN:
            return None
        if self._pending.get(seg.segment_id):
            # Reservations still open: set it aside; it is sealed when they end.
            if self._dirty:
                self._interval_sync()
            self._draining[seg.segment_id] = _Draining(seg, self._tail.footer)
            self._tail.segment = None
            self._tail.footer = []
            self._tail.unsealed_since = None
            return None
        self._seal(seg, self._tail.footer)
        self._tail.segment = None
        self._tail.footer = []
        self._tail.unsealed_since = None
        self._dirty = False
        return seg.segment_id

    def _unsealed(self) -> None:
        """The open segment holds a record (or a reservation) that is not sealed yet."""
        if self._tail.unsealed_since is None:
            self._tail.unsealed_since = time.monotonic()

    def _seal(self, seg: SegmentFile, footer: list[FooterEntry]) -> None:
        end = seg.size
        footer.sort(key=lambda fe: fe.offset)  # commits of reservations come in any order
        seg.seal(footer)
        self._life.sealed(self.tenant, seg.segment_id, end)
        self._metrics.inc("kvstore_segments_sealed_total")
        if self._on_sealed is not None:
            self._on_sealed(seg.segment_id)

    def _seal_drained(self) -> None:
        """Seal the segments set aside whose reservations have all ended."""
        for sid in [sid for sid in self._draining if not self._pending.get(sid)]:
            d = self._draining.pop(sid)
            try:
                self._seal(d.segment, d.footer)
            except OSError as e:
                # Left open: recovery seals it at the next start (an unsealed
                # segment that is not the newest is cut to what was indexed).
                log.error("could not seal %s after its write plans ended: %s", d.segment.name, e)

    # -- write plans (executor side) ---------------------------------------------

    def _reserve_space(self, headers: list[RecordHeader]) -> list[Reservation]:
        total = sum(h.record_len for h in headers)
        try:
            seg = self._segment_for(total)
        except OSError as e:
            raise _io_error(e, "sealing the full segment or creating the next one") from None
        if self._direct_io is None:
            self._direct_io = directio.supported(self._dir)
        start = seg.size
        out: list[Reservation] = []
        try:
            os.posix_fallocate(seg.fd, start, total)  # the client's writes never meet a full disk
            pos = start
            for h in headers:
                os.pwrite(seg.fd, pad(self.tenant, h.record_len), pos)
                out.append(Reservation(seg, pos, h, self._direct_io))
                pos += h.record_len
            seg.size = pos
            self._life.appended(self.tenant, seg.segment_id, [], seg.size, self._tail.synced_upto)
        except Exception as e:  # noqa: BLE001 - undo the reservation whatever failed
            self._undo(seg, start)
            raise _batch_error(e, f"reserving {total} bytes in {seg.name}") from None
        self._dirty = True  # the pads: synced with the next batch or commit
        self._unsealed()
        self._pending[seg.segment_id] = self._pending.get(seg.segment_id, 0) + len(out)
        self._reserved.update(h.key for h in headers)
        return out

    def _footer_of(self, seg: SegmentFile) -> list[FooterEntry] | None:
        if seg is self._tail.segment:
            return self._tail.footer
        d = self._draining.get(seg.segment_id)
        return d.footer if d is not None and d.segment is seg else None

    def _commit(self, items: list[tuple[Reservation, RecordHeader, bytes | None]]) -> list[IndexEntry | None]:
        try:
            return self._commit_headers(items)
        finally:
            self._end([r for r, _, _ in items])

    def _commit_headers(self, items: list[tuple[Reservation, RecordHeader, bytes | None]]) -> list[IndexEntry | None]:
        by_seg: dict[int, list[tuple[Reservation, RecordHeader, bytes | None]]] = {}
        results: dict[int, IndexEntry | None] = {}
        for item in items:
            r, h, _ = item
            if self._footer_of(r.segment) is None:
                raise StorageIOError(f"the segment of a write plan's reservation ({r.segment.name}) is gone")
            if self._index.get(self.tenant, h.key) is not None:
                results[id(item)] = None  # written meanwhile: the first write wins
                continue
            by_seg.setdefault(r.segment.segment_id, []).append(item)
        fsync = self._cfg.durability == "fsync"
        for group in by_seg.values():
            seg = group[0][0].segment
            footer = self._footer_of(seg)
            assert footer is not None
            written: list[int] = []
            try:
                for r, h, _ in group:
                    if h.record_len < r.header.record_len:  # the room the record does not need: a pad
                        _write_page(seg, pad(self.tenant, r.header.record_len - h.record_len), r.offset + h.record_len)
                    raw = h.encode()
                    written.append(r.offset)
                    _write_page(seg, raw + bytes(h.payload_offset - len(raw)), r.offset)
                tail = seg is self._tail.segment
                if fsync or not tail:
                    seg.sync()
                    if tail:
                        self._tail.synced_upto = seg.size
                synced = self._tail.synced_upto if tail else seg.size
                fes = [footer_entry(r.offset, h) for r, h, _ in group]
                ops = [(fe.key, index_entry(seg.segment_id, fe)) for fe in fes]
                idents = {h.key: ident for _, h, ident in group if ident is not None}
                self._life.appended(self.tenant, seg.segment_id, ops, seg.size, synced, idents)
            except Exception as e:  # noqa: BLE001 - put the pads back: nothing half-committed is indexed
                for (r, _, _), at in zip(group, written, strict=False):
                    with contextlib.suppress(OSError):
                        _write_page(seg, pad(self.tenant, r.header.record_len), at)
                raise _batch_error(e, f"committing {len(group)} planned records in {seg.name}") from None
            footer.extend(fes)
            if not fsync and tail:
                self._dirty = True
            self._metrics.observe("kvstore_batch_records", len(group))
            self._metrics.inc("kvstore_bytes_written_total", sum(h.record_len for _, h, _ in group))
            for item, (_, entry) in zip(group, ops, strict=True):
                results[id(item)] = entry
        return [results[id(item)] for item in items]

    def _end(self, reservations: list[Reservation]) -> None:
        for r in reservations:
            sid = r.segment.segment_id
            left = self._pending.get(sid, 0) - 1
            if left > 0:
                self._pending[sid] = left
            else:
                self._pending.pop(sid, None)
            self._reserved.discard(r.header.key)
        if self._draining:
            self._seal_drained()


def _write_page(seg: SegmentFile, page: bytes, offset: int) -> None:
    """Pages (a header, a pad) inside a segment's records, through the
    descriptor its records are written with."""
    if seg.dfd >= 0:
        directio.pwrite_direct(seg.dfd, [page], offset)
    else:
        os.pwrite(seg.fd, page, offset)


def _fail(batch: list[_Write], e: KVStoreError) -> None:
    for item in batch:
        if item.future is not None and not item.future.done():
            item.future.set_exception(e)


@contextlib.contextmanager
def _all(keys: Sequence[str]) -> Iterator[Sequence[str]]:
    yield keys


def _io_error(e: OSError, doing: str) -> KVStoreError:
    if e.errno == errno.ENOSPC:
        return StorageFull(f"no space left on device while {doing}")
    return StorageIOError(f"I/O error while {doing}: {e.strerror or e}")


def _batch_error(e: Exception, doing: str) -> KVStoreError:
    """A batch's failure (its writes already undone): a full disk or index
    stays :class:`StorageFull`, so a removal retries with the space reserve
    released (reserve.py); anything else is an I/O error."""
    if isinstance(e, OSError):
        return _io_error(e, doing)
    if isinstance(e, StorageFull):
        return e
    return StorageIOError(f"index commit failed while {doing}: {e}")
