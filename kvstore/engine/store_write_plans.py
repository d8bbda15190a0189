"""Write plans: a client on this host writes a block's bytes into the
tenant's segment itself, and the store indexes them once they check out.

Three steps, each its own call:

1. :meth:`plan_writes` takes the keys and sizes. For each key that is new
   it claims the key (no other write of it runs until the plan ends),
   admits the bytes against the disk and the tenant's quota, and has the
   tenant's appender reserve room for the record at the end of the open
   segment: allocated on disk, marked with a pad record (format.py), so a
   scan steps over it whatever happens next. A key that exists is answered
   as a put of it would be (``created`` False, nothing to write), and so is
   a new key its tenant's admission declines (NotAdmitted, nothing to
   write: the offer is counted here, where the client would write it).
2. The client writes each block's bytes at ``offset`` of the segment file
   (a descriptor the transport passes; only its own tenant's file), padded
   with zeros to ``length``, from host memory or GPU memory.
3. :meth:`commit_writes` with each frame's xxh3-64: the store reads the
   bytes back (``O_DIRECT`` where it can: no page-cache copy), checks them,
   and the appender writes the record's header over its pad, syncs under
   the durability policy and indexes the block, in order with the tenant's
   other writes. A key whose bytes do not match is refused
   (``422 checksum_mismatch``) and its space stays a pad.

A plan not committed within its lease (or abandoned) ends: its pads stay as
dead space that compaction takes back, its keys and quota are released.
What the client writes after the check is caught by the checksums every
read verifies: damaged bytes are reported as corruption, never served. A
kill at any step leaves a pad (not indexed: nothing served) or an indexed,
checked record; recovery steps over pads.

A direct tenant's blocks are stored raw, in the tenant's frame size. A
sealed tenant's blocks are planned only for a client that encodes them
itself (``encode="client"``, over a connection where a record's own key may
go: the transport decides): the plan gives each record its identity (a
random record id, the tenant's current key version) and its own frame key
(HKDF of the tenant's data key: never the data key itself), and reserves
the most room its frames can take (each frame's plaintext and tag). The
client compresses and seals the frames as the daemon would
(kvstore_client/wire/sealing.py) and commits each frame's stored length,
codec and xxh3-64; the store checks the frame table against the plan, the
checksums, and every frame's AES-GCM tag under the record's binding
(tenant, key, record id, key version, index, frame count, size), so a
forged, truncated, replayed or misbound record is refused
(``422 record_rejected``) and never indexed. The room the frames did not
need becomes a pad.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore_client.wire.sealing import FrameBinding

from kvstore.buffers import POOL
from kvstore.engine import directio
from kvstore.engine.appender import Appender, Reservation
from kvstore.engine.crypto import RecordCipher, derive_frame_key
from kvstore.engine.format import CODEC_RAW, CODECS_KNOWN, GCM_TAG, FrameEntry, RecordHeader, checksum
from kvstore.engine.record import as_written, new_record_id, planned, scratch
from kvstore.engine.registry import Tenant
from kvstore.engine.segment import Buffer, padding, pwrite_all
from kvstore.engine.store_core import StoreCore
from kvstore.engine.types import BlockInfo, Stored
from kvstore.errors import (
    BlockTooLarge,
    CorruptionError,
    InvalidInput,
    KVStoreError,
    NotAdmitted,
    NotPlannable,
    RecordRejected,
    StorageFull,
    StorageIOError,
    StoreClosed,
    WritePlanNotFound,
    WrittenBytesMismatch,
)
from kvstore.events.model import BlockMeta
from kvstore.names import validate_key

log = logging.getLogger("kvstore.engine.write_plans")
SWEEP_S = 1.0
MAX_LEASE_S = 600.0


@dataclass(frozen=True, slots=True)
class ClientSealing:
    """What a client needs to seal a planned record's frames itself."""

    record_id: bytes
    key_version: int
    frame_key: bytes  # this record's only
    compression: str  # the tenant's: the codec to try on each frame
    level: int


@dataclass(frozen=True, slots=True)
class PlannedWrite:
    """Where the client writes one block: ``length`` bytes (the block, then
    zeros up to an ALIGN multiple) at ``offset`` of its segment's file, in
    frames of ``frame_size``: all of it read off its reservation."""

    key: str
    reservation: Reservation
    sealing: ClientSealing | None = None  # a sealed record the client encodes

    @property
    def size(self) -> int:
        return self.reservation.header.logical_size

    @property
    def frame_size(self) -> int:
        return self.reservation.header.frame_size

    @property
    def offset(self) -> int:
        return self.reservation.payload_at

    @property
    def length(self) -> int:
        h = self.reservation.header
        return h.record_len - h.payload_offset

    @property
    def path(self) -> str:
        return os.path.abspath(self.reservation.segment.path)


@dataclass(slots=True)
class WritePlan:
    id: str
    tenant: Tenant
    expires: float  # time.monotonic()
    writes: dict[str, PlannedWrite]
    #: keys with nothing to write: stored already (created False)
    existing: dict[str, Stored]
    metas: dict[str, BlockMeta] = field(default_factory=dict)
    claims: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    quota: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    app: Appender | None = None
    ended: bool = False
    #: keys with nothing to write: the tenant's admission declined them
    declined: dict[str, NotAdmitted] = field(default_factory=dict)
    #: planned keys admission counted (admission.py): told once stored
    counted: set[str] = field(default_factory=set)


class StoreWritePlans(StoreCore):
    async def plan_writes(
        self,
        tenant: str,
        items: Sequence[tuple[str, int]],
        lease_s: float,
        metas: Mapping[str, BlockMeta] | None = None,
        encode: str = "server",
    ) -> WritePlan:
        """Reserve room for each (key, size) of ``items`` (see the module's
        doc); the plan ends at :meth:`commit_writes`, :meth:`abandon_writes`
        or ``lease_s`` seconds from now. Fails as a whole on invalid input."""
        t = self._tenant(tenant)
        if encode not in ("server", "client"):
            raise InvalidInput(f"field 'encode' must be 'server' or 'client'; got {encode!r}")
        client_seals = t.policy != "direct"
        if client_seals and encode != "client":
            raise NotPlannable(
                f"tenant {tenant!r} is {t.policy}: its records are compressed and encrypted, by the daemon "
                "(PUT its blocks) or by the client (ask with encode=client, where a record's key may go)"
            )
        if not 0 < lease_s <= MAX_LEASE_S:
            raise InvalidInput(f"field 'lease_s' must be in (0, {MAX_LEASE_S:g}]; got {lease_s!r}")
        seen: set[str] = set()
        for key, size in items:
            validate_key(key)
            if key in seen:
                raise InvalidInput(f"key {key!r} appears twice in one write plan")
            seen.add(key)
            if size <= 0:
                raise InvalidInput(f"block {key!r}: 'size' must be 1 or more; got {size}")
            if size > self.config.max_block_size:
                raise BlockTooLarge(f"block {key!r} is {size} bytes; the maximum is {self.config.max_block_size}")
            self._retention.check_block(t, size)
        fs = self.config.frame_size_of(t.frame_size)
        plan = WritePlan(secrets.token_hex(16), t, time.monotonic() + lease_s, {}, {}, dict(metas or {}))
        try:
            headers: list[RecordHeader] = []
            for key, size in sorted(items):  # claimed in one order: two plans never wait on each other
                plan.claims[key] = await self._serialize(tenant, key)
                existing = self._index.get(tenant, key)
                if existing is not None:
                    self.access.touch(tenant, key)
                    plan.existing[key] = Stored(False, BlockInfo.of(key, existing))
                    self._release(tenant, key, plan.claims.pop(key))
                    continue
                try:
                    if self.admission.check(t, key, size):
                        plan.counted.add(key)
                except NotAdmitted as e:
                    plan.declined[key] = e
                    self._release(tenant, key, plan.claims.pop(key))
                    continue
                kv = t.key_version if client_seals else None
                headers.append(planned(t.name, key, size, fs, new_record_id(), kv))
            if headers:
                total = sum(h.record_len for h in headers)
                await self._residency.admit(total)
                await plan.quota.enter_async_context(self._retention.reserve(t, total))
                plan.app = self._appender(t)
                try:
                    reserved = await plan.app.reserve(headers)
                except StorageFull:
                    self._residency.filled()
                    raise
                self._residency.space.wrote(total)
                for r in reserved:
                    h = r.header
                    sealing = None
                    if client_seals:
                        data_key = self._registry.data_key(t.name, h.key_version)
                        frame_key = derive_frame_key(data_key, h.record_id, t.name, h.key_version)
                        sealing = ClientSealing(
                            h.record_id, h.key_version, frame_key, t.compression, self.config.zstd_level
                        )
                    plan.writes[h.key] = PlannedWrite(h.key, r, sealing)
        except BaseException:
            await self._end_plan(plan)
            raise
        if plan.writes:
            self._write_plans[plan.id] = plan
            self.metrics.inc("kvstore_write_plans_total", result="planned")
        else:
            await self._end_plan(plan)
        return plan

    def plans_writes(self, tenant: str) -> bool:
        """Whether ``tenant``'s blocks can be written through a plan with the
        daemon as the writer (a direct tenant: stored as written)."""
        return self._tenant(tenant).policy == "direct"

    def write_plan(self, tenant: str, plan_id: str) -> WritePlan:
        """The open plan ``plan_id`` of ``tenant`` (WritePlanNotFound: ended,
        expired, another tenant's, or never given)."""
        plan = self._write_plans.get(plan_id)
        if plan is None or plan.tenant.name != tenant or plan.ended:
            raise WritePlanNotFound(
                f"no open write plan {plan_id!r} of this tenant: committed, abandoned, expired or never given"
            )
        return plan

    async def commit_writes(
        self,
        tenant: str,
        plan_id: str,
        written: Mapping[str, Sequence[FrameEntry | int]],
        read_back: bool = True,
    ) -> dict[str, Stored | KVStoreError]:
        """Check and index the blocks of plan ``plan_id`` given in
        ``written`` (key -> each frame of what the client wrote: its stored
        length, codec and xxh3-64; of a direct block, just each frame's
        xxh3-64 will do: its frames are raw, their lengths the plan's); the plan ends, and its keys not given are
        abandoned. Each key's answer: the block as stored, or why it was not.
        ``read_back`` False: the bytes were written by this process and the
        checksums taken from them (NIXL's landings): they are not read back.
        (A client's commit is always read back and checked.)"""
        plan = self.write_plan(tenant, plan_id)
        unknown = [k for k in written if k not in plan.writes]
        if unknown:
            raise InvalidInput(f"key(s) not in write plan {plan_id}: {', '.join(sorted(unknown)[:10])}")
        tables: dict[str, list[FrameEntry]] = {}
        for key, frames in written.items():
            tables[key] = _frame_table(plan.writes[key], frames)
        del self._write_plans[plan_id]
        plan.ended = True
        out: dict[str, Stored | KVStoreError] = {}
        try:
            given = [plan.writes[k] for k in tables]
            check = _check_written if read_back else _as_written
            checked = await asyncio.gather(*(self._run(check, w, tables[w.key]) for w in given))
            app = plan.app
            if app is None or self._appender(plan.tenant) is not app:  # TenantNotFound if deleted meanwhile
                raise StoreClosed(f"tenant {tenant!r} was closed while write plan {plan_id} was open; plan again")
            commits: list[tuple[Reservation, RecordHeader, bytes | None]] = []
            for w, result in zip(given, checked, strict=True):
                if isinstance(result, KVStoreError):
                    out[w.key] = result
                    continue
                meta = plan.metas.get(w.key)
                ident = self._ident_blob(plan.tenant, w.key, meta) if meta is not None else None
                commits.append((w.reservation, result, ident))
            committed = {r.header.key for r, _, _ in commits}
            if commits:
                entries = await app.commit(commits)
                stored_keys, sizes, metas = [], [], []
                for (r, _, _), entry in zip(commits, entries, strict=True):
                    key = r.header.key
                    if entry is None:
                        now = self._index.get(tenant, key)
                        out[key] = Stored(False, BlockInfo.of(key, now)) if now is not None else WritePlanNotFound(key)
                        continue
                    out[key] = Stored(True, BlockInfo.of(key, entry))
                    if key in plan.counted:
                        self.admission.stored(plan.tenant, key, entry.logical_size)
                    stored_keys.append(key)
                    sizes.append(entry.logical_size)
                    metas.append(plan.metas.get(key) or BlockMeta.of_key(key))
                self._stored(tenant, "put", "local", stored_keys, sizes, metas)
                self.metrics.inc("kvstore_puts_total", len(stored_keys), result="created")
                self.metrics.inc("kvstore_bytes_in_total", sum(sizes))
            # Reservations not committed (not given, or their bytes did not match) end here.
            rest = [w.reservation for k, w in plan.writes.items() if k not in committed]
            if rest:
                await app.abandon(rest)
            self.metrics.inc("kvstore_write_plans_total", result="committed")
        finally:
            plan.writes.clear()  # ended by the appender
            await self._end_plan(plan)
        return out

    async def upload_planned(self, tenant: str, plan_id: str, key: str, data: memoryview) -> None:
        """Write ``data`` (a block's bytes as stored: its sealed frames back
        to back, or a direct block) into the room plan ``plan_id`` reserved
        for ``key``, for a client that cannot write the file itself (a plan
        over TCP: the bytes come in a request body). Checked at the commit
        like a client's own writes."""
        plan = self.write_plan(tenant, plan_id)
        w = plan.writes.get(key)
        if w is None:
            raise InvalidInput(
                f"key {key!r} is not in write plan {plan_id} (or it exists, or was not admitted: nothing to write)"
            )
        if not 0 < len(data) <= w.length:
            raise InvalidInput(f"block {key!r}: {len(data)} bytes do not fit the {w.length} reserved for it")
        try:
            await self._run(_write_into, w, data)
        except OSError as e:
            raise StorageIOError(f"block {key!r}: writing into its reserved room failed: {e.strerror or e}") from None

    async def abandon_writes(self, tenant: str, plan_id: str) -> None:
        """End plan ``plan_id`` without storing anything."""
        plan = self.write_plan(tenant, plan_id)
        await self._abandon(plan, "abandoned")

    async def _abandon(self, plan: WritePlan, why: str) -> None:
        self._write_plans.pop(plan.id, None)
        if plan.ended:
            return
        plan.ended = True
        try:
            if plan.app is not None and plan.writes:
                with contextlib.suppress(KVStoreError):  # a closing or deleted tenant: its appender is gone
                    await plan.app.abandon([w.reservation for w in plan.writes.values()])
            self.metrics.inc("kvstore_write_plans_total", result=why)
        finally:
            plan.writes.clear()
            await self._end_plan(plan)

    async def _end_plan(self, plan: WritePlan) -> None:
        for key, claim in list(plan.claims.items()):
            self._release(plan.tenant.name, key, claim)
        plan.claims.clear()
        await plan.quota.aclose()

    async def end_write_plans(self, plan_ids: Sequence[str]) -> None:
        """End these plans if still open (their connection closed)."""
        for pid in plan_ids:
            plan = self._write_plans.get(pid)
            if plan is not None:
                await self._abandon(plan, "abandoned")

    async def expire_write_plans(self) -> int:
        """End the plans whose lease ran out; returns how many."""
        now = time.monotonic()
        late = [p for p in self._write_plans.values() if p.expires <= now]
        for plan in late:
            log.info("write plan %s of tenant %s expired uncommitted", plan.id, plan.tenant.name)
            await self._abandon(plan, "expired")
        return len(late)

    async def write_plan_sweeper(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            await self.expire_write_plans()

    async def abandon_all_write_plans(self) -> None:
        """At close: every open plan ends."""
        for plan in list(self._write_plans.values()):
            await self._abandon(plan, "abandoned")


def _frame_table(w: PlannedWrite, given: Sequence[FrameEntry | int]) -> list[FrameEntry]:
    """The frames a client says it wrote, checked against the plan
    (InvalidInput naming what does not fit): their count; a direct block's
    lengths and codec are the plan's (its checksums alone will do); a sealed
    frame holds its tag and at most its plaintext, in a known codec, raw
    only at its plaintext's length."""
    reserved = w.reservation.header
    if not given and w.sealing is None:
        # No checksums given (a client writing from GPU memory has no host copy
        # to take them from): taken from what landed, at the read-back (UNSUMMED).
        return [FrameEntry(reserved.frame_plain_len(i), CODEC_RAW, UNSUMMED) for i in range(len(reserved.frames))]
    frames: list[FrameEntry] = []
    for i, f in enumerate(given):
        if isinstance(f, FrameEntry):
            frames.append(f)
        elif w.sealing is not None:
            raise InvalidInput(f"block {w.key!r} is sealed by the client: give each frame's length, codec and xxh3")
        else:
            frames.append(FrameEntry(reserved.frame_plain_len(i), CODEC_RAW, f))
    if len(frames) != len(reserved.frames):
        raise InvalidInput(f"block {w.key!r}: {len(reserved.frames)} frames are planned; {len(frames)} were given")
    for i, f in enumerate(frames):
        plain = reserved.frame_plain_len(i)
        if w.sealing is None:
            ok = f.stored_len == plain and f.codec == CODEC_RAW
        else:
            exact = f.stored_len == plain + GCM_TAG
            ok = (
                f.codec in CODECS_KNOWN
                and GCM_TAG <= f.stored_len <= plain + GCM_TAG
                and (f.codec != CODEC_RAW or exact)
            )
        if not ok:
            raise InvalidInput(
                f"block {w.key!r}: frame {i} ({f.stored_len} bytes, codec {f.codec}) does not fit its plan "
                f"({plain} bytes of plaintext{'' if w.sealing is None else ' and a 16-byte tag'})"
            )
    return frames


UNSUMMED = -1  # a frame whose checksum the client did not give


def _as_written(w: PlannedWrite, frames: Sequence[FrameEntry]) -> RecordHeader | KVStoreError:
    """The record's final header, its frames as given (not read back)."""
    if any(f.checksum == UNSUMMED for f in frames):
        return InvalidInput(f"block {w.key!r}: its frames' checksums are needed (nothing is read back)")
    return as_written(w.reservation.header, tuple(frames))


def _check_written(w: PlannedWrite, frames: Sequence[FrameEntry]) -> RecordHeader | KVStoreError:
    """Read back what the client wrote for ``w`` and check each frame: its
    xxh3-64, and a sealed one's AES-GCM tag under the record's binding.
    The record's final header, or why not."""
    seg = w.reservation.segment
    h = w.reservation.header
    table = list(frames)
    header = as_written(h, tuple(table))
    length = header.record_len - header.payload_offset
    buf = POOL.take(length)
    view = buf.view
    try:
        _read_back(seg.path, seg.fd, view, w.offset, w.reservation.direct)
        cipher = None
        if w.sealing is not None:
            s = w.sealing
            binding = FrameBinding(s.record_id, s.key_version, len(table), h.logical_size, h.tenant, h.key)
            cipher = RecordCipher.with_frame_key(s.frame_key, binding)
        pos = 0
        for i, f in enumerate(table):
            stored = view[pos : pos + f.stored_len]
            got = checksum(stored)
            if f.checksum == UNSUMMED:
                table[i] = FrameEntry(f.stored_len, f.codec, got)
            elif got != f.checksum:
                return WrittenBytesMismatch(
                    f"block {w.key!r}: frame {i} of the bytes written does not match its xxh3 "
                    f"({got:016x}, the client gave {f.checksum:016x}); it is not stored"
                )
            if cipher is not None:
                try:
                    cipher.open_into(i, stored, scratch(f.stored_len - GCM_TAG))
                except CorruptionError:
                    return RecordRejected(
                        f"block {w.key!r}: frame {i} is not sealed under this record's key and binding "
                        "(tenant, key, record id, key version, frame index, frame count, size); it is not stored"
                    )
            pos += f.stored_len
    except OSError as e:
        return StorageIOError(f"block {w.key!r}: reading back the bytes written failed: {e.strerror or e}")
    finally:
        view.release()
        buf.release()
    return as_written(h, tuple(table))


def _write_into(w: PlannedWrite, data: memoryview) -> None:
    """``data`` then zeros up to an ALIGN multiple, at ``w.offset`` of its
    segment: with O_DIRECT where the segment is written so."""
    seg = w.reservation.segment
    parts: list[Buffer] = [data, padding(len(data))]
    if not w.reservation.direct:
        pwrite_all(seg.fd, parts, w.offset)
        return
    fd = os.open(seg.path, os.O_WRONLY | directio.O_DIRECT)
    try:
        directio.pwrite_direct(fd, parts, w.offset)
    finally:
        os.close(fd)


def _read_back(path: Path, fd: int, view: memoryview, offset: int, direct: bool) -> None:
    """Fill ``view`` (page-aligned, an ALIGN multiple) from the file: with
    ``O_DIRECT`` where the segment is written so (the bytes a client wrote
    with O_DIRECT are not in the page cache: reading them through it would
    cost the copy write plans avoid), else through ``fd`` (from the page
    cache, where a client's buffered writes are)."""
    dfd = -1
    if direct:
        try:
            dfd = os.open(path, os.O_RDONLY | directio.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    try:
        pos, done = offset, 0
        while done < len(view):
            n = os.preadv(dfd if dfd >= 0 else fd, [view[done:]], pos)
            if n == 0:
                raise OSError(errno.EIO, f"segment ends before the planned bytes ({done} of {len(view)})")
            done += n
            pos += n
    finally:
        if dfd >= 0:
            os.close(dfd)
