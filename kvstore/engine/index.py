"""The LMDB index: (tenant, key) -> where the record is, and per-segment state.

The index is a cache of what the segments say: every entry can be rebuilt from
segment records and footers (recovery.py). It is committed once per batch, in
the same transaction as the segment's ``indexed_upto`` watermark, so recovery
knows exactly which tail of a segment the index has not seen.

Databases (all keys are bytes):
    blocks    tenant 0x00 key            -> ENTRY
    segments  tenant 0x00 u64be(seg id)  -> SEGMENT
    stats     tenant                     -> STATS (live blocks, stored, logical bytes)
    tiers     tenant 0x00 u64be(seg id)  -> TIER (sealed segments known to the object
                                            tier: mirrored? local copy? size)
    live      tenant 0x00 u64be(seg id)  -> LIVE (records and bytes of the segment that
                                            entries point at: the rest is dead, for compaction)
    access    tenant 0x00 key            -> u64 unix milliseconds of the block's last read or write,
                                            checkpointed from memory (access.py); absent: created_ns
    order     tenant 0x00 u64be(ms) key  -> b"": every block under its last read or write (the later
                                            of created_ns and its access time), oldest first: the
                                            quota's LRU and the TTL walk it from the front, so their
                                            cost follows what goes, not what stays (retention.py)
    meta      b"format"                  -> u32 index format version
              b"epoch"                   -> u64, bumped whenever a segment's local file goes away
                                            (dropped, retired, deleted): readers poll it (lifecycle.py)

Every change of a segment's state goes through lifecycle.py (the only caller
of the methods that write ``segments`` and ``tiers``); this module only stores
what it is told, in one transaction per call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import struct
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import IndexUnusable, KVStoreError, NewerFormat, StorageFull, StorageIOError

log = logging.getLogger("kvstore.engine.index")

ENTRY = struct.Struct("<QQQIQHI16sQ")
SEGMENT = struct.Struct("<BQQQ")  # state, indexed_upto, synced_upto, wait_upto
STATS = struct.Struct("<qqq")
TIER = struct.Struct("<BQQ")  # flags, object size, when the upload was confirmed (ns)
LIVE = struct.Struct("<qq")  # live records, live record bytes
ACCESS = struct.Struct("<Q")  # unix milliseconds
FRESH = struct.Struct("<Q")  # a tenant's record bytes on probation
MAX_ARRIVALS = 100_000  # new blocks kept for a watched tenant between drains, at most (about 20 MB)
EPOCH = struct.Struct("<Q")
INDEX_FORMAT = 3  # 2: live and access dbs, the epoch, the retired state; 3: the order db
# What this release opens: format 2 is migrated in place by the writer (its
# order db built from the blocks and access dbs, once); an older format is
# rebuilt from the segments; a newer one is refused (NewerFormat), the index
# left as it is.
INDEX_FORMATS_READ = (2, 3)
MIGRATE_CHUNK = 50_000  # order entries built per write transaction when migrating format 2
_SEP = b"\x00"

SEG_OPEN = 0
SEG_SEALED = 1
SEG_RETIRED = 2  # compacted: nothing points into it; its files go once no lease holds them

TIER_MIRRORED = 1  # the object tier holds the whole sealed segment (upload confirmed)
TIER_REMOTE_ONLY = 2  # no local copy: reads go to the object tier


@dataclass(frozen=True, slots=True)
class IndexEntry:
    segment_id: int
    offset: int
    record_len: int
    payload_offset: int
    logical_size: int
    flags: int
    key_version: int
    record_id: bytes
    created_ns: int

    def pack(self) -> bytes:
        return ENTRY.pack(
            self.segment_id,
            self.offset,
            self.record_len,
            self.payload_offset,
            self.logical_size,
            self.flags,
            self.key_version,
            self.record_id,
            self.created_ns,
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> IndexEntry:
        return cls(*ENTRY.unpack(raw))


@dataclass(frozen=True, slots=True)
class SegmentState:
    state: int
    indexed_upto: int
    synced_upto: int
    # Retired segments that were in the object tier: their object is deleted
    # once the tenant's segments up to this id (where compaction copied their
    # records) are mirrored too.
    wait_upto: int = 0


@dataclass(frozen=True, slots=True)
class TierState:
    flags: int
    size: int
    mirrored_ns: int

    @property
    def mirrored(self) -> bool:
        return bool(self.flags & TIER_MIRRORED)

    @property
    def local(self) -> bool:
        return not self.flags & TIER_REMOTE_ONLY


@dataclass(frozen=True, slots=True)
class UsageStats:
    blocks: int = 0
    stored_bytes: int = 0
    logical_bytes: int = 0


def _write_error(e: lmdb.Error, doing: str) -> KVStoreError:
    """LMDB's failure to write, in the store's terms: ENOSPC and a full map
    are :class:`StorageFull` (the space reserve makes room for removals,
    reserve.py), never corruption; other failures :class:`StorageIOError`."""
    if isinstance(e, lmdb.MapFullError):
        return StorageFull(f"the index's map is full while {doing} (map_size); nothing was committed")
    if isinstance(e, lmdb.DiskError) and "no space" in str(e).lower():
        return StorageFull(f"no space left on device while {doing}; nothing was committed")
    return StorageIOError(f"I/O error while {doing}: {e}")


@contextlib.contextmanager
def _lmdb_errors(doing: str, path: Path | None = None) -> Generator[None, None, None]:
    try:
        yield
    except (lmdb.DiskError, lmdb.MapFullError) as e:
        raise _write_error(e, doing) from None
    except lmdb.Error as e:
        # LMDB answers a short write with EIO (mdb_page_flush): on a full
        # filesystem that is what ENOSPC looks like (seen on a full tmpfs).
        if path is not None and "input/output error" in str(e).lower() and _nearly_full(path):
            raise StorageFull(f"no space left on device while {doing} (a short write); nothing was committed") from None
        raise


def _nearly_full(path: Path) -> bool:
    """Whether the filesystem of ``path`` has less than a MiB free."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _bkey(tenant: str, key: str) -> bytes:
    return tenant.encode() + _SEP + key.encode()


def _created_ms(entry: IndexEntry) -> int:
    return entry.created_ns // 1_000_000


# A block's kind in the order db: on probation (not read since it was stored:
# no access time, or one from before it was stored), or read since it was
# stored. Each kind is in order by itself; a walk of both merges them.
ON_PROBATION, READ_AGAIN = b"\x00", b"\x01"
KINDS = (ON_PROBATION, READ_AGAIN)


def _kind(created_ms: int, accessed: int) -> bytes:
    return READ_AGAIN if accessed and accessed >= created_ms else ON_PROBATION


def _order_key(prefix: bytes, kind: bytes, ms: int, key: bytes) -> bytes:
    """A block's key in the order db: ``prefix`` is ``tenant 0x00``, then its
    kind, its last read or write (big-endian milliseconds) and its key."""
    return prefix + kind + ms.to_bytes(8, "big") + key


def _place(entry: IndexEntry, accessed: int) -> tuple[bytes, int]:
    """A block's kind and its time in the order db."""
    created = _created_ms(entry)
    return _kind(created, accessed), max(created, accessed)


def _skey(tenant: str, segment_id: int) -> bytes:
    return tenant.encode() + _SEP + segment_id.to_bytes(8, "big")


def _back_reader_table(path: Path, open_env: Callable[[], lmdb.Environment]) -> None:
    """Give every page of LMDB's lock file (its reader table, mapped shared)
    disk space, before this process opens the environment. LMDB sizes the
    file with ftruncate, so its pages are holes until a thread's first read
    writes its slot there; on a full filesystem that write is SIGBUS, which
    kills the worker. Allocated here, at start-up, a full disk only costs
    this warning.

    Never after the open: LMDB's share of the file is a POSIX record lock,
    which closing *any* descriptor of the file drops for the whole process.
    The next process to open the environment then believes it is the only
    one and initialises the lock file again, wiping the reader table and the
    writer's transaction id under the running writer: pages still read get
    reused, and a later commit built on a stale meta page corrupted the
    free list for good (the stress test's ``mdb_page_touch`` assertion).
    Hence the file is created, if missing, by opening the environment once
    and closing it (a close of our own environment is allowed: it holds the
    locks it drops)."""
    lock_file = path / "lock.mdb"
    if not lock_file.exists():
        open_env().close()
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return  # LMDB placed it elsewhere: nothing of ours to back
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        log.warning(
            "the index's reader table %s could not be given disk space (%s): reads on a full disk may fail",
            lock_file,
            e,
        )
    finally:
        os.close(fd)


class Index:
    def __init__(
        self, path: Path, sync: bool = True, map_size: int = 64 << 30, readonly: bool = False, lock: bool = True
    ) -> None:
        """Open (or create) the index. ``readonly``: another process owns the
        writes (a reader worker); LMDB lets both share the environment.
        ``lock=False``: no process may write meanwhile (the caller holds the
        store's lock); then not even LMDB's reader table is written."""
        self.path = path
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)

        def open_env() -> lmdb.Environment:
            return lmdb.open(
                str(path),
                map_size=map_size,
                max_dbs=16,
                subdir=True,
                sync=sync,
                metasync=False,  # the last commit may be lost in a crash; recovery replays it
                readahead=False,
                max_readers=1024,
                readonly=readonly,
                create=not readonly,
                lock=lock,
            )

        try:
            if lock and not readonly:
                _back_reader_table(path, open_env)
            self.env = open_env()
            self._blocks = self.env.open_db(b"blocks", create=not readonly)
            self._segments = self.env.open_db(b"segments", create=not readonly)
            self._stats = self.env.open_db(b"stats", create=not readonly)
            self._meta = self.env.open_db(b"meta", create=not readonly)
            self._tiers = self.env.open_db(b"tiers", create=not readonly)
            self._live = self.env.open_db(b"live", create=not readonly)
            self._access = self.env.open_db(b"access", create=not readonly)
            # A block's engine identity (Kvstore-Block-Meta), removed with its entry.
            self._idents = self.env.open_db(b"idents", create=not readonly)
            self._order = self.env.open_db(b"order", create=not readonly) if not readonly else None
            # Each tenant's learned eviction state (engine/eviction.py), by
            # name: the writer's alone, as the order is.
            self._policy = self.env.open_db(b"policy", create=True) if not readonly else None
            # Each tenant's bytes of blocks on probation (u64): kept by every
            # change, as the stats are; absent: not counted yet (fresh_bytes).
            self._fresh = self.env.open_db(b"fresh", create=True) if not readonly else None
            # Blocks indexed since the last drain (new keys, not moves), for
            # the tenants watched (under probation: retention.py checks them
            # against its ghosts); guarded by a lock: indexing runs on threads.
            self._arrivals: dict[str, list[tuple[str, IndexEntry]]] = {}
            self._arrivals_lock = threading.Lock()
            with self.env.begin(write=not readonly) as txn:
                fmt = txn.get(b"format", db=self._meta)
                if fmt is None and not readonly:
                    txn.put(b"format", struct.pack("<I", INDEX_FORMAT), db=self._meta)
            found = struct.unpack("<I", fmt)[0] if fmt is not None and len(fmt) == 4 else None
            if found == 2 and not readonly:
                self._migrate_to_3()
            if fmt is not None and found not in INDEX_FORMATS_READ:
                self.env.close()
                if NewerFormat.is_newer(found, INDEX_FORMATS_READ):
                    # Not rebuilt: that would throw away what a later release
                    # keeps only there; the operator decides (the message says how).
                    raise NewerFormat(
                        f"index {str(path)!r}",
                        found,
                        INDEX_FORMATS_READ,
                        also=f"; or remove {str(path)!r}, which this release then rebuilds from the segments "
                        "(the access times and engine identities kept only in the index are lost)",
                    )
                raise IndexUnusable(f"index format {found if found is not None else fmt!r} is not {INDEX_FORMAT}")
        except lmdb.Error as e:
            failure = _write_error(e, f"opening the index at {str(path)!r}")
            if isinstance(failure, StorageFull):  # not a damaged index: a rebuild would not help (and needs space)
                raise failure from None
            raise IndexUnusable(f"index at {str(path)!r} cannot be opened: {e}") from None

    def _migrate_to_3(self) -> None:
        """Format 2 to 3: build the order db from the blocks and access dbs
        (once, in chunks of ``MIGRATE_CHUNK`` blocks; the format moves to 3 in
        the last chunk's transaction, so a crash half-way starts over)."""
        order = self._db_order()
        after = b""
        built = 0
        while True:
            with self._writing() as txn:
                if after == b"":
                    txn.drop(order, delete=False)  # what a crashed migration left
                cur = txn.cursor(db=self._blocks)
                found = cur.set_range(after) if after else cur.first()
                n = 0
                while found and n < MIGRATE_CHUNK:
                    bk, raw = cur.item()
                    if bk != after:
                        tenant, key = bk.split(_SEP, 1)
                        kind, last = self._place_of(txn, bk, IndexEntry.unpack(raw))
                        txn.put(_order_key(tenant + _SEP, kind, last, key), b"", db=order)
                        n += 1
                        after = bytes(bk)
                    found = cur.next()
                built += n
                if not found:
                    txn.put(b"format", struct.pack("<I", INDEX_FORMAT), db=self._meta)
                    break
        log.info("index migrated to format %d: %d blocks put in access order", INDEX_FORMAT, built)

    def _db_order(self) -> Any:
        if self._order is None:
            raise KVStoreError("the index was opened read-only: it has no access order to walk")
        return self._order

    def _place_of(self, txn: lmdb.Transaction, bk: bytes, entry: IndexEntry) -> tuple[bytes, int]:
        """A block's place in the order db: its kind and its last read or write."""
        raw = txn.get(bk, db=self._access)
        return _place(entry, ACCESS.unpack(raw)[0] if raw is not None else 0)

    @staticmethod
    def destroy(path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self.env.close()

    def sync(self) -> None:
        with _lmdb_errors("syncing the index", self.path):
            self.env.sync(True)

    @contextlib.contextmanager
    def _writing(self) -> Generator[Any, None, None]:
        """A write transaction, committed at the end; a full disk or map is
        :class:`StorageFull` (nothing of it was committed), never corruption."""
        with _lmdb_errors("committing to the index", self.path), self.env.begin(write=True) as txn:
            yield txn

    # -- the lifecycle epoch --------------------------------------------------

    def epoch(self) -> int:
        with self.env.begin(db=self._meta) as txn:
            raw = txn.get(b"epoch")
        return EPOCH.unpack(raw)[0] if raw else 0

    def bump_epoch(self) -> None:
        """Move the epoch with no segment change: reader workers then look at
        their open files again (a scrub found damage: verified.py)."""
        with self._writing() as txn:
            self._bump_epoch(txn)

    def _bump_epoch(self, txn: lmdb.Transaction) -> None:
        raw = txn.get(b"epoch", db=self._meta)
        txn.put(b"epoch", EPOCH.pack((EPOCH.unpack(raw)[0] if raw else 0) + 1), db=self._meta)

    # -- reads ----------------------------------------------------------------

    def get(self, tenant: str, key: str) -> IndexEntry | None:
        with self.env.begin(db=self._blocks, buffers=False) as txn:
            raw = txn.get(_bkey(tenant, key))
        return IndexEntry.unpack(raw) if raw is not None else None

    def contains(self, tenant: str, keys: Sequence[str]) -> list[bool]:
        prefix = tenant.encode() + _SEP
        with self.env.begin(db=self._blocks, buffers=True) as txn:
            get = txn.get
            return [get(prefix + k.encode()) is not None for k in keys]

    def keys(self, tenant: str, start_after: str | None, limit: int) -> list[str]:
        return [k for k, _ in self.entries(tenant, start_after, limit)]

    def stats(self, tenant: str) -> UsageStats:
        with self.env.begin(db=self._stats) as txn:
            raw = txn.get(tenant.encode())
        return UsageStats(*STATS.unpack(raw)) if raw else UsageStats()

    def _scan(self, db: Any, tenant: str, after: bytes = b"") -> Generator[tuple[bytes, bytes], None, None]:
        """(key suffix, value) of ``db``'s entries of ``tenant``, in key order,
        from just after suffix ``after`` (one read transaction)."""
        prefix = tenant.encode() + _SEP
        with self.env.begin(db=db) as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix + after):
                return
            for k, v in cur:
                if not k.startswith(prefix):
                    return
                yield k[len(prefix) :], v

    def segments(self, tenant: str) -> dict[int, SegmentState]:
        return {
            int.from_bytes(k, "big"): SegmentState(*SEGMENT.unpack(v)) for k, v in self._scan(self._segments, tenant)
        }

    def segment(self, tenant: str, segment_id: int) -> SegmentState | None:
        with self.env.begin(db=self._segments) as txn:
            raw = txn.get(_skey(tenant, segment_id))
        return SegmentState(*SEGMENT.unpack(raw)) if raw is not None else None

    def live(self, tenant: str) -> dict[int, tuple[int, int]]:
        """Live (records, bytes) of each of the tenant's segments that entries point into."""
        return {int.from_bytes(k, "big"): LIVE.unpack(v) for k, v in self._scan(self._live, tenant)}

    def live_of(self, tenant: str, segment_id: int) -> tuple[int, int]:
        """Live (records, bytes) of one segment ((0, 0): none), one read."""
        with self.env.begin(db=self._live) as txn:
            raw = txn.get(_skey(tenant, segment_id))
        return LIVE.unpack(raw) if raw is not None else (0, 0)

    def entries(
        self, tenant: str, start_after: str | None, limit: int, prefix: str = ""
    ) -> list[tuple[str, IndexEntry]]:
        """A page of the tenant's (key, entry) pairs in key order (those
        whose key starts with ``prefix``)."""
        after = start_after.encode() + b"\x00" if start_after is not None else b""
        first = max(after, prefix.encode())
        with contextlib.closing(self._scan(self._blocks, tenant, first)) as scan:  # ends its transaction
            pairs = takewhile(lambda kv: kv[0].startswith(prefix.encode()), scan) if prefix else scan
            return [(k.decode(), IndexEntry.unpack(v)) for k, v in islice(pairs, limit)]

    def policy_states(self) -> dict[str, bytes]:
        """Every tenant's learned eviction state, as :meth:`save_policy_states` kept it."""
        if self._policy is None:
            return {}
        with self.env.begin(db=self._policy) as txn:
            return {bytes(k).decode(): bytes(v) for k, v in txn.cursor()}

    def save_policy_states(self, states: Mapping[str, bytes | None]) -> None:
        """Keep each tenant's eviction state (None: drop it), in one transaction."""
        db = self._policy
        if db is None:
            raise KVStoreError("the index was opened read-only: eviction states are the writer's")
        with self._writing() as txn:
            for tenant, raw in states.items():
                if raw is None:
                    txn.delete(tenant.encode(), db=db)
                else:
                    txn.put(tenant.encode(), raw, db=db)

    def accessed(self, tenant: str, keys: Sequence[str]) -> list[int]:
        """Checkpointed last-access milliseconds of ``keys`` (0 where none is recorded)."""
        with self.env.begin(db=self._access, buffers=True) as txn:
            out = []
            for k in keys:
                raw = txn.get(_bkey(tenant, k))
                out.append(ACCESS.unpack(raw)[0] if raw is not None else 0)
            return out

    def record_access(self, tenant: str, times: Iterable[tuple[str, int]]) -> None:
        """Checkpoint last-access milliseconds (only for keys that still
        exist; an access time never moves back), moving each block in the
        order db."""
        order = self._db_order()
        prefix = tenant.encode() + _SEP
        fresh = 0
        with self._writing() as txn:
            for key, ms in times:
                bk = prefix + key.encode()
                raw = txn.get(bk, db=self._blocks)
                if raw is None:
                    continue
                entry = IndexEntry.unpack(raw)
                cur = txn.get(bk, db=self._access)
                was = ACCESS.unpack(cur)[0] if cur is not None else 0
                if ms <= was:
                    continue
                txn.put(bk, ACCESS.pack(ms), db=self._access)
                before, after = _place(entry, was), _place(entry, ms)
                if after != before:
                    txn.delete(_order_key(prefix, *before, key.encode()), db=order)
                    txn.put(_order_key(prefix, *after, key.encode()), b"", db=order)
                if before[0] == ON_PROBATION and after[0] == READ_AGAIN:
                    fresh -= entry.record_len
            self._add_fresh(txn, tenant, fresh)

    def oldest(
        self,
        tenant: str,
        after: tuple[int, str] | None,
        limit: int,
        before_ms: int | None = None,
        kind: bytes | None = None,
    ) -> list[tuple[int, str, IndexEntry]]:
        """A page of the tenant's blocks in the order of their last read or
        write, oldest first: (milliseconds, key, entry), from just after
        ``after`` (a (milliseconds, key) this walk returned), only those last
        touched before ``before_ms`` if given; only those of ``kind``
        (ON_PROBATION, READ_AGAIN) if given, else both, merged. A walk's
        cost is the page's."""
        if kind is not None:
            return self._oldest_of(tenant, kind, after, limit, before_ms)
        both = [*self._oldest_of(tenant, ON_PROBATION, after, limit, before_ms)]
        both += self._oldest_of(tenant, READ_AGAIN, after, limit, before_ms)
        # (a kind's page that is full ends past every block taken here: the
        # first ``limit`` of the two pages merged are the walk's next ones)
        both.sort(key=lambda b: (b[0], b[1]))
        return both[:limit]

    def _oldest_of(
        self, tenant: str, kind: bytes, after: tuple[int, str] | None, limit: int, before_ms: int | None
    ) -> list[tuple[int, str, IndexEntry]]:
        order = self._db_order()
        prefix = tenant.encode() + _SEP
        head = prefix + kind
        start = _order_key(prefix, kind, after[0], after[1].encode() + b"\x00") if after else head
        out: list[tuple[int, str, IndexEntry]] = []
        with self.env.begin(buffers=True) as txn:
            cur = txn.cursor(db=order)
            if not cur.set_range(start):
                return out
            for k in cur.iternext(keys=True, values=False):
                if len(out) >= limit or bytes(k[: len(head)]) != head:
                    break
                ms = int.from_bytes(k[len(head) : len(head) + 8], "big")
                if before_ms is not None and ms >= before_ms:
                    break
                key = bytes(k[len(head) + 8 :])
                raw = txn.get(prefix + key, db=self._blocks)
                if raw is not None:
                    out.append((ms, key.decode(), IndexEntry.unpack(raw)))
        return out

    def watch_arrivals(self, tenant: str) -> None:
        """From now on keep the tenant's new blocks for :meth:`arrivals`."""
        with self._arrivals_lock:
            self._arrivals.setdefault(tenant, [])

    def arrivals(self, tenant: str) -> list[tuple[str, IndexEntry]] | None:
        """The watched tenant's blocks indexed (new keys) since the last
        call; None when more than ``MAX_ARRIVALS`` came (they were not kept)."""
        with self._arrivals_lock:
            out = self._arrivals.get(tenant)
            self._arrivals[tenant] = []
            return None if out is None or len(out) > MAX_ARRIVALS else out

    def _arrived(self, tenant: str, key: str, entry: IndexEntry) -> None:
        # (under the lock: a drain swaps the list; a transaction that then
        # fails leaves an arrival its reader finds absent from the index)
        with self._arrivals_lock:
            kept = self._arrivals.get(tenant)
            if kept is not None and len(kept) <= MAX_ARRIVALS:
                kept.append((key, entry))

    def unwatch_arrivals(self, tenant: str) -> None:
        with self._arrivals_lock:
            self._arrivals.pop(tenant, None)

    def _add_fresh(self, txn: lmdb.Transaction, tenant: str, delta: int) -> None:
        """Move the tenant's bytes on probation by ``delta`` (not yet counted: left so)."""
        if not delta or self._fresh is None:
            return
        raw = txn.get(tenant.encode(), db=self._fresh)
        if raw is not None:
            txn.put(tenant.encode(), FRESH.pack(max(0, FRESH.unpack(raw)[0] + delta)), db=self._fresh)

    def fresh_bytes(self, tenant: str) -> int:
        """The record bytes of the tenant's blocks on probation (not read
        since they were stored). Kept by every change; an index that has not
        counted them yet (migrated from format 2) counts them once, here."""
        fresh = self._fresh
        if fresh is None:
            raise KVStoreError("the index was opened read-only: the bytes on probation are the writer's")
        with self.env.begin(db=fresh) as txn:
            raw = txn.get(tenant.encode())
        if raw is not None:
            return int(FRESH.unpack(raw)[0])
        with self._writing() as txn:
            head = tenant.encode() + _SEP + ON_PROBATION
            total = 0
            cur = txn.cursor(db=self._db_order())
            if cur.set_range(head):
                for k in cur.iternext(keys=True, values=False):
                    if not k.startswith(head):
                        break
                    raw = txn.get(tenant.encode() + _SEP + k[len(head) + 8 :], db=self._blocks)
                    total += IndexEntry.unpack(raw).record_len if raw is not None else 0
            txn.put(tenant.encode(), FRESH.pack(total), db=fresh)
        return total

    def idents(self, tenant: str, keys: Sequence[str]) -> list[bytes | None]:
        """The stored engine identities of ``keys`` (None: stored without one)."""
        with self.env.begin() as txn:
            return [txn.get(_bkey(tenant, k), db=self._idents) for k in keys]

    def tier_state(self, tenant: str, segment_id: int) -> TierState | None:
        with self.env.begin(db=self._tiers) as txn:
            raw = txn.get(_skey(tenant, segment_id))
        return TierState(*TIER.unpack(raw)) if raw is not None else None

    def tier_states(self) -> dict[tuple[str, int], TierState]:
        """Every segment's tier state, by (tenant, segment id)."""
        out: dict[tuple[str, int], TierState] = {}
        with self.env.begin(db=self._tiers) as txn:
            for k, v in txn.cursor():
                tenant, sid = k.split(_SEP, 1)
                out[(tenant.decode(), int.from_bytes(sid, "big"))] = TierState(*TIER.unpack(v))
        return out

    def tenants(self) -> set[str]:
        """Tenants that have anything in the index: one cursor seek per
        tenant and database (a tenant's keys are skipped over, not read)."""
        names: set[str] = set()
        with self.env.begin() as txn:
            for k in txn.cursor(db=self._stats).iternext(keys=True, values=False):
                names.add(bytes(k).decode())
            for db in (self._segments, self._blocks):
                cur = txn.cursor(db=db)
                found = cur.first()
                while found:
                    tenant = bytes(cur.key()).split(_SEP, 1)[0]
                    names.add(tenant.decode())
                    found = cur.set_range(tenant + b"\x01")  # past every "tenant 0x00 ..." key
        return names

    # -- writes ---------------------------------------------------------------

    def apply(
        self,
        tenant: str,
        ops: Iterable[tuple[str, IndexEntry | None]],
        segment_id: int,
        segment: SegmentState | None,
        idents: Mapping[str, bytes] | None = None,
    ) -> None:
        """Apply puts (entry) and deletes (None) in order, in one transaction,
        together with the segment's new state, the tenant's usage and the
        live bytes of every segment the ops point into or away from.
        ``idents``: the engine identities of keys put (a delete drops one)."""
        with self._writing() as txn:
            self._apply(txn, tenant, ops, idents)
            if segment is not None:
                self._put_segment(txn, tenant, segment_id, segment)

    def _apply(
        self,
        txn: lmdb.Transaction,
        tenant: str,
        ops: Iterable[tuple[str, IndexEntry | None]],
        idents: Mapping[str, bytes] | None = None,
    ) -> None:
        raw = txn.get(tenant.encode(), db=self._stats)
        blocks, stored, logical = STATS.unpack(raw) if raw else (0, 0, 0)
        live: dict[int, list[int]] = {}

        def count(sid: int, records: int, nbytes: int) -> None:
            acc = live.get(sid)
            if acc is None:
                cur = txn.get(_skey(tenant, sid), db=self._live)
                acc = live[sid] = list(LIVE.unpack(cur)) if cur else [0, 0]
            acc[0] += records
            acc[1] += nbytes

        order = self._db_order()
        prefix = tenant.encode() + _SEP
        fresh = 0
        watched = tenant in self._arrivals
        for key, entry in ops:
            bk = _bkey(tenant, key)
            old = txn.get(bk, db=self._blocks)
            raw_access = txn.get(bk, db=self._access) if old is not None else None
            accessed = ACCESS.unpack(raw_access)[0] if raw_access is not None else 0
            if old is not None:
                o = IndexEntry.unpack(old)
                blocks, stored, logical = blocks - 1, stored - o.record_len, logical - o.logical_size
                count(o.segment_id, -1, -o.record_len)
                kind, ms = _place(o, accessed)
                txn.delete(_order_key(prefix, kind, ms, key.encode()), db=order)
                fresh -= o.record_len if kind == ON_PROBATION else 0
            if entry is None:
                if old is not None:
                    txn.delete(bk, db=self._blocks)
                    txn.delete(bk, db=self._access)
                    txn.delete(bk, db=self._idents)
            else:
                if old is None and watched:
                    self._arrived(tenant, key, entry)
                txn.put(bk, entry.pack(), db=self._blocks)
                kind, ms = _place(entry, accessed)
                txn.put(_order_key(prefix, kind, ms, key.encode()), b"", db=order)
                fresh += entry.record_len if kind == ON_PROBATION else 0
                if idents and key in idents:
                    txn.put(bk, idents[key], db=self._idents)
                blocks, stored, logical = blocks + 1, stored + entry.record_len, logical + entry.logical_size
                count(entry.segment_id, 1, entry.record_len)
        txn.put(tenant.encode(), STATS.pack(blocks, stored, logical), db=self._stats)
        if raw is None and self._fresh is not None:  # a tenant's first blocks: counted from the start
            txn.put(tenant.encode(), FRESH.pack(0), db=self._fresh)
        self._add_fresh(txn, tenant, fresh)
        for sid, (records, nbytes) in live.items():
            if records <= 0:
                txn.delete(_skey(tenant, sid), db=self._live)
            else:
                txn.put(_skey(tenant, sid), LIVE.pack(records, nbytes), db=self._live)

    def _put_segment(self, txn: lmdb.Transaction, tenant: str, segment_id: int, segment: SegmentState) -> None:
        txn.put(
            _skey(tenant, segment_id),
            SEGMENT.pack(segment.state, segment.indexed_upto, segment.synced_upto, segment.wait_upto),
            db=self._segments,
        )

    def drop_if_current(self, tenant: str, victims: Iterable[tuple[str, IndexEntry]]) -> list[str]:
        """Remove the entries of ``victims`` (key, expected entry) that are
        still current, in one transaction; return the keys removed."""
        removed: list[str] = []
        with self._writing() as txn:
            ops: list[tuple[str, IndexEntry | None]] = []
            for key, expected in victims:
                raw = txn.get(_bkey(tenant, key), db=self._blocks)
                if raw is not None and IndexEntry.unpack(raw) == expected:
                    ops.append((key, None))
                    removed.append(key)
            if ops:
                self._apply(txn, tenant, ops)
        return removed

    def set_segment_states(
        self, tenant: str, segment_id: int, segment: SegmentState | None, tier: TierState | None, epoch: bool = False
    ) -> None:
        """Set (None: keep) the segment's state and tier state in one
        transaction; ``epoch``: a local file goes away, tell the readers."""
        with self._writing() as txn:
            if segment is not None:
                self._put_segment(txn, tenant, segment_id, segment)
            if tier is not None:
                txn.put(_skey(tenant, segment_id), TIER.pack(tier.flags, tier.size, tier.mirrored_ns), db=self._tiers)
            if epoch:
                self._bump_epoch(txn)

    def forget_segment(self, tenant: str, segment_id: int) -> None:
        with self._writing() as txn:
            txn.delete(_skey(tenant, segment_id), db=self._segments)
            txn.delete(_skey(tenant, segment_id), db=self._tiers)
            txn.delete(_skey(tenant, segment_id), db=self._live)
            self._bump_epoch(txn)

    def entries_in(self, tenant: str, segment_id: int) -> list[tuple[str, IndexEntry]]:
        """The tenant's (key, entry) pairs that point into segment ``segment_id``."""
        pairs = ((k.decode(), IndexEntry.unpack(v)) for k, v in self._scan(self._blocks, tenant))
        return [(k, e) for k, e in pairs if e.segment_id == segment_id]

    def drop_entries(self, tenant: str, doomed: Callable[[IndexEntry], bool]) -> int:
        """Delete the tenant's entries for which ``doomed(entry)``; return how many."""
        victims = [k.decode() for k, v in self._scan(self._blocks, tenant) if doomed(IndexEntry.unpack(v))]
        if victims:
            self.apply(tenant, ((k, None) for k in victims), 0, None)
        return len(victims)

    def drop_tenant(self, tenant: str) -> None:
        prefix = tenant.encode() + _SEP
        with self._writing() as txn:
            self._bump_epoch(txn)
            for db in (
                self._blocks,
                self._segments,
                self._tiers,
                self._live,
                self._access,
                self._idents,
                self._db_order(),
            ):
                cur = txn.cursor(db=db)
                if cur.set_range(prefix):
                    while cur.key().startswith(prefix):
                        if not cur.delete():
                            break
            txn.delete(tenant.encode(), db=self._stats)
            for db in (self._policy, self._fresh):
                if db is not None:
                    txn.delete(tenant.encode(), db=db)
