"""The gateway's catalog: buckets, objects, multipart uploads, in SQLite.

An object's bytes are kvstore blocks of the bucket's tenant (keys
``s3~<uid>~<n>``, see :mod:`kvstore.buckets.objects`); the catalog maps
``(bucket, key)`` to those blocks and to what S3 reports about the object
(size, ETag, time, metadata). It lives in its own file
(``<data_dir>/s3/catalog.sqlite3``), in WAL mode with ``synchronous=FULL``:
a change is on disk before the request is answered.

The catalog is a cache of the gateway's records, as the LMDB index is of the
segments: every row but ``completed`` names (column ``record``) a small
block of the bucket's tenant that says the same (:mod:`.records`), written
before the row is committed and deleted after the row is, so a node rebuilt
from its bucket gets its names back (:mod:`.recovery`). ``PRAGMA
user_version`` says how far the catalog is in line with the records:
:data:`LEGACY` (made before records existed: the truth, records are written
for it), :data:`REBUILDING` (new, or a rebuild did not finish: rebuilt from
the records at start-up), :data:`MIRRORED` (the truth while the disk lives).
It is the catalog's format version too: a later format of the catalog sets
a value above :data:`MIRRORED`, which this release refuses
(:class:`~kvstore.errors.NewerFormat`) before it writes anything.

Keys are stored as their UTF-8 bytes (BLOB), so SQLite's ``memcmp`` order is
S3's listing order. Every call runs on the catalog's one thread, in order.

Tables:
    buckets  name -> tenant, the tenant's incarnation (its creation time: a
             bucket of a deleted tenant is not the new one's), created, region
             (and in every table but ``completed``: record, its record's key)
    objects  (bucket, key) -> size, etag, mtime, meta (JSON, sealed for a
             sealed tenant), blocks (JSON [[block key, length], ...])
    uploads  upload id -> bucket, key, created, meta
    parts    (upload id, part number) -> size, etag, mtime, blocks
    completed upload id -> bucket, key, etag: uploads completed in the last
             :data:`COMPLETED_KEPT_NS`, so a repeated Complete answers as
             the first did (S3 does); kept on this disk only
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvstore.errors import NewerFormat, NotFound

T = TypeVar("T")
Extents = list[tuple[str, int]]  # (block key, length), in the object's order
COMPLETED_KEPT_NS = 24 * 3600 * 10**9
LEGACY, REBUILDING, MIRRORED = 0, 1, 2  # PRAGMA user_version: see the module's docstring
# The catalog's format is its user_version: this release writes and reads
# these; a later format sets a higher one, which this release refuses.
FORMATS_READ = (LEGACY, REBUILDING, MIRRORED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (
    name TEXT PRIMARY KEY, tenant TEXT NOT NULL, incarnation INTEGER NOT NULL,
    created_ns INTEGER NOT NULL, region TEXT NOT NULL, record TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS buckets_by_tenant ON buckets (tenant);
CREATE TABLE IF NOT EXISTS objects (
    bucket TEXT NOT NULL, key BLOB NOT NULL, size INTEGER NOT NULL, etag TEXT NOT NULL,
    mtime_ns INTEGER NOT NULL, meta BLOB NOT NULL, blocks TEXT NOT NULL, record TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (bucket, key)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS uploads (
    upload_id TEXT PRIMARY KEY, bucket TEXT NOT NULL, key BLOB NOT NULL,
    created_ns INTEGER NOT NULL, meta BLOB NOT NULL, record TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS uploads_by_bucket ON uploads (bucket, key, upload_id);
CREATE TABLE IF NOT EXISTS completed (
    upload_id TEXT PRIMARY KEY, bucket TEXT NOT NULL, key BLOB NOT NULL, etag TEXT NOT NULL,
    completed_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS parts (
    upload_id TEXT NOT NULL, part INTEGER NOT NULL, size INTEGER NOT NULL, etag TEXT NOT NULL,
    mtime_ns INTEGER NOT NULL, blocks TEXT NOT NULL, record TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (upload_id, part)
) WITHOUT ROWID;
"""


_TABLES = ("buckets", "objects", "uploads", "parts")


class NoSuchUpload(NotFound):
    """The multipart upload is gone (completed or aborted meanwhile)."""

    code = "no_such_upload"


@dataclass(frozen=True, slots=True)
class Bucket:
    name: str
    tenant: str
    incarnation: int
    created_ns: int
    region: str
    record: str = ""  # its record's block key ("": none yet, see recovery)


@dataclass(frozen=True, slots=True)
class ObjectRow:
    key: bytes
    size: int
    etag: str  # with its quotes, as S3 sends it
    mtime_ns: int
    meta: bytes
    blocks: Extents
    record: str = ""


@dataclass(frozen=True, slots=True)
class Upload:
    upload_id: str
    bucket: str
    key: bytes
    created_ns: int
    meta: bytes
    record: str = ""


@dataclass(frozen=True, slots=True)
class PartRow:
    part: int
    size: int
    etag: str
    mtime_ns: int
    blocks: Extents
    record: str = ""


@dataclass(slots=True)
class Dropped:
    """What a change left unnamed, to delete from the store once it is
    committed: blocks (through :class:`~.objects.Readers`, which waits for
    reads in flight) and records."""

    blocks: Extents = field(default_factory=list)
    records: list[str] = field(default_factory=list)

    def add(self, blocks: Extents, record: str) -> None:
        self.blocks += blocks
        if record:
            self.records.append(record)


def _extents(text: str) -> Extents:
    return [(str(k), int(n)) for k, n in json.loads(text)]


def _text(extents: Extents) -> str:
    return json.dumps([[k, n] for k, n in extents], separators=(",", ":"))


def _object(row: tuple[Any, ...]) -> ObjectRow:
    return ObjectRow(bytes(row[0]), row[1], row[2], row[3], bytes(row[4]), _extents(row[5]), row[6])


def _upload(row: tuple[Any, ...]) -> Upload:
    return Upload(row[0], row[1], bytes(row[2]), row[3], bytes(row[4]), row[5])


def _part(row: tuple[Any, ...]) -> PartRow:
    return PartRow(row[0], row[1], row[2], row[3], _extents(row[4]), row[5])


_OBJECT_COLS = "key, size, etag, mtime_ns, meta, blocks, record"
_BUCKET_COLS = "name, tenant, incarnation, created_ns, region, record"
_UPLOAD_COLS = "upload_id, bucket, key, created_ns, meta, record"
_PART_COLS = "part, size, etag, mtime_ns, blocks, record"


def _bucket(db: sqlite3.Connection, name: str) -> Bucket | None:
    row = db.execute(f"SELECT {_BUCKET_COLS} FROM buckets WHERE name = ?", (name,)).fetchone()
    return Bucket(*row) if row else None


def _get(db: sqlite3.Connection, bucket: str, key: bytes) -> ObjectRow | None:
    row = db.execute(f"SELECT {_OBJECT_COLS} FROM objects WHERE bucket = ? AND key = ?", (bucket, key)).fetchone()
    return _object(row) if row else None


class Catalog:
    """The catalog file; every method runs on its own thread (``run``)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        found = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        # A later release's catalog: refused before anything here writes to it.
        if NewerFormat.is_newer(found, FORMATS_READ):
            self._db.close()
            raise NewerFormat(
                f"S3 gateway catalog {str(path)!r}",
                found,
                FORMATS_READ,
                restore="it",
                also=f"; or remove {str(path)!r} (and its -wal and -shm files), which this release then "
                "rebuilds from the gateway's records",
            )
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'buckets'").fetchone() is None:
            # New (or created by a start that crashed before its tables): its
            # first write says so, so a crash from here on is a rebuild left
            # to finish, never an empty catalog taken for the truth.
            self._db.execute(f"PRAGMA user_version={REBUILDING}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        for table in _TABLES:  # a catalog made before records existed
            cols = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if "record" not in cols:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN record TEXT NOT NULL DEFAULT ''")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="s3-catalog")
        # Point reads on the event loop's thread (a bucket, an object: tens of
        # microseconds from the page cache, less than a hop to the catalog's
        # thread): WAL lets this second connection read while the other writes.
        self._reader = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._reader.execute("PRAGMA query_only=1")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._reader.close()
        self._db.close()

    @property
    def state(self) -> int:
        """:data:`LEGACY`, :data:`REBUILDING` or :data:`MIRRORED`."""
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def set_state(self, state: int) -> None:
        self._db.execute(f"PRAGMA user_version={int(state)}")

    def bucket_now(self, name: str) -> Bucket | None:
        """:meth:`bucket`, on the caller's thread (the event loop's)."""
        return _bucket(self._reader, name)

    def get_now(self, bucket: str, key: bytes) -> ObjectRow | None:
        """:meth:`get`, on the caller's thread (the event loop's)."""
        return _get(self._reader, bucket, key)

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(self._db)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return out

    # -- buckets --------------------------------------------------------------

    def bucket(self, name: str) -> Bucket | None:
        return _bucket(self._db, name)

    def buckets(self, tenant: str) -> list[Bucket]:
        rows = self._db.execute(
            f"SELECT {_BUCKET_COLS} FROM buckets WHERE tenant = ? ORDER BY name",
            (tenant,),
        ).fetchall()
        return [Bucket(*r) for r in rows]

    def all_buckets(self) -> list[Bucket]:
        rows = self._db.execute(f"SELECT {_BUCKET_COLS} FROM buckets").fetchall()
        return [Bucket(*r) for r in rows]

    def create_bucket(self, bucket: Bucket) -> Bucket | None:
        """Create ``bucket``; the existing one of that name (nothing created) if any."""

        def tx(db: sqlite3.Connection) -> Bucket | None:
            found = self.bucket(bucket.name)
            if found is not None:
                return found
            db.execute(
                "INSERT INTO buckets VALUES (?, ?, ?, ?, ?, ?)",
                (bucket.name, bucket.tenant, bucket.incarnation, bucket.created_ns, bucket.region, bucket.record),
            )
            return None

        return self._tx(tx)

    def delete_bucket(self, name: str, only_if_empty: bool = True) -> tuple[bool, Dropped]:
        """Delete the bucket (False: it holds objects) with its uploads; the
        blocks and records that go with them (to delete from the store)."""

        def tx(db: sqlite3.Connection) -> tuple[bool, Dropped]:
            if only_if_empty and db.execute("SELECT 1 FROM objects WHERE bucket = ? LIMIT 1", (name,)).fetchone():
                return False, Dropped()
            found = self.bucket(name)
            dropped = Dropped()
            if found is None:
                return True, dropped
            dropped.add([], found.record)
            for text, record in db.execute("SELECT blocks, record FROM objects WHERE bucket = ?", (name,)):
                dropped.add(_extents(text), record)
            ids = [r[0] for r in db.execute("SELECT upload_id FROM uploads WHERE bucket = ?", (name,))]
            for upload_id in ids:
                self._drop_upload(db, upload_id, dropped)
            db.execute("DELETE FROM objects WHERE bucket = ?", (name,))
            db.execute("DELETE FROM buckets WHERE name = ?", (name,))
            return True, dropped

        return self._tx(tx)

    # -- objects --------------------------------------------------------------

    def get(self, bucket: str, key: bytes) -> ObjectRow | None:
        return _get(self._db, bucket, key)

    def put(self, bucket: str, obj: ObjectRow, expect: Callable[[ObjectRow | None], None] | None = None) -> Dropped:
        """Store (or replace) the object; the replaced object's blocks and
        record. ``expect`` sees the current object first and may raise (a
        conditional write): then nothing changes."""

        def tx(db: sqlite3.Connection) -> Dropped:
            old = self.get(bucket, obj.key)
            if expect is not None:
                expect(old)
            self._insert_object(db, bucket, obj)
            dropped = Dropped()
            if old is not None:
                dropped.add(old.blocks, old.record)
            return dropped

        return self._tx(tx)

    @staticmethod
    def _insert_object(db: sqlite3.Connection, bucket: str, obj: ObjectRow) -> None:
        db.execute(
            "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (bucket, obj.key, obj.size, obj.etag, obj.mtime_ns, obj.meta, _text(obj.blocks), obj.record),
        )

    def delete(self, bucket: str, key: bytes, only_if_blocks: Extents | None = None) -> Dropped:
        """Delete the object; its blocks and record. ``only_if_blocks``:
        only if it is still that version (its blocks are these)."""

        def tx(db: sqlite3.Connection) -> Dropped:
            old = self.get(bucket, key)
            dropped = Dropped()
            if old is None or (only_if_blocks is not None and old.blocks != only_if_blocks):
                return dropped
            db.execute("DELETE FROM objects WHERE bucket = ? AND key = ?", (bucket, key))
            dropped.add(old.blocks, old.record)
            return dropped

        return self._tx(tx)

    def list_objects(self, bucket: str, after: bytes | None, prefix: bytes, limit: int) -> list[ObjectRow]:
        """Up to ``limit`` objects with keys starting with ``prefix`` and
        greater than ``after``, in byte order."""
        lo = prefix if after is None or after < prefix else after
        op = ">=" if after is None or after < prefix else ">"
        # 0xff never occurs in UTF-8: every key starting with the prefix is below prefix+0xff.
        rows = self._db.execute(
            f"SELECT {_OBJECT_COLS} FROM objects WHERE bucket = ? AND key {op} ? AND key < ? ORDER BY key LIMIT ?",
            (bucket, lo, prefix + b"\xff", limit),
        ).fetchall()
        return [_object(r) for r in rows]

    # -- multipart uploads ------------------------------------------------------

    def create_upload(self, upload: Upload) -> None:
        self._tx(lambda db: self._insert_upload(db, upload))

    @staticmethod
    def _insert_upload(db: sqlite3.Connection, upload: Upload) -> None:
        db.execute(
            "INSERT INTO uploads VALUES (?, ?, ?, ?, ?, ?)",
            (upload.upload_id, upload.bucket, upload.key, upload.created_ns, upload.meta, upload.record),
        )

    def upload(self, upload_id: str) -> Upload | None:
        row = self._db.execute(f"SELECT {_UPLOAD_COLS} FROM uploads WHERE upload_id = ?", (upload_id,)).fetchone()
        return _upload(row) if row else None

    def uploads(self, bucket: str, prefix: bytes, after: tuple[bytes, str] | None, limit: int) -> list[Upload]:
        key_after, id_after = after if after is not None else (b"", "")
        rows = self._db.execute(
            f"SELECT {_UPLOAD_COLS} FROM uploads WHERE bucket = ? AND key >= ? AND key < ?"
            " AND (key > ? OR (key = ? AND upload_id > ?)) ORDER BY key, upload_id LIMIT ?",
            (bucket, prefix, prefix + b"\xff", key_after, key_after, id_after, limit),
        ).fetchall()
        return [_upload(r) for r in rows]

    def put_part(self, upload_id: str, part: PartRow) -> tuple[bool, Dropped]:
        """Record a part (replacing one of the same number); (whether the
        upload still exists, the blocks and records no longer needed: the
        new part's own when it does not)."""

        def tx(db: sqlite3.Connection) -> tuple[bool, Dropped]:
            dropped = Dropped()
            if self.upload(upload_id) is None:
                dropped.add(part.blocks, part.record)
                return False, dropped
            old = db.execute(
                "SELECT blocks, record FROM parts WHERE upload_id = ? AND part = ?", (upload_id, part.part)
            ).fetchone()
            self._insert_part(db, upload_id, part)
            if old:
                dropped.add(_extents(old[0]), old[1])
            return True, dropped

        return self._tx(tx)

    @staticmethod
    def _insert_part(db: sqlite3.Connection, upload_id: str, part: PartRow) -> None:
        db.execute(
            "INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?, ?, ?)",
            (upload_id, part.part, part.size, part.etag, part.mtime_ns, _text(part.blocks), part.record),
        )

    def parts(self, upload_id: str, after: int = 0, limit: int = 10_000) -> list[PartRow]:
        rows = self._db.execute(
            f"SELECT {_PART_COLS} FROM parts WHERE upload_id = ? AND part > ? ORDER BY part LIMIT ?",
            (upload_id, after, limit),
        ).fetchall()
        return [_part(r) for r in rows]

    def _drop_upload(self, db: sqlite3.Connection, upload_id: str, dropped: Dropped) -> None:
        found = self.upload(upload_id)
        if found is not None:
            dropped.add([], found.record)
        for text, record in db.execute("SELECT blocks, record FROM parts WHERE upload_id = ?", (upload_id,)):
            dropped.add(_extents(text), record)
        db.execute("DELETE FROM parts WHERE upload_id = ?", (upload_id,))
        db.execute("DELETE FROM uploads WHERE upload_id = ?", (upload_id,))

    def completed(self, upload_id: str) -> tuple[str, bytes, str] | None:
        """(bucket, key, ETag) of an upload completed lately."""
        row = self._db.execute("SELECT bucket, key, etag FROM completed WHERE upload_id = ?", (upload_id,)).fetchone()
        return (row[0], bytes(row[1]), row[2]) if row else None

    def abort(self, upload_id: str) -> tuple[bool, Dropped]:
        def tx(db: sqlite3.Connection) -> tuple[bool, Dropped]:
            dropped = Dropped()
            if self.upload(upload_id) is None:
                return False, dropped
            self._drop_upload(db, upload_id, dropped)
            return True, dropped

        return self._tx(tx)

    def complete(
        self, upload: Upload, obj: ObjectRow, used: set[int], expect: Callable[[ObjectRow | None], None] | None = None
    ) -> Dropped:
        """Make the upload the object: the parts numbered in ``used`` become
        its blocks (``obj.blocks``); the other parts' blocks, every part's
        record, the upload's, and the replaced object's blocks and record
        are returned, to delete."""

        def tx(db: sqlite3.Connection) -> Dropped:
            if self.upload(upload.upload_id) is None:
                raise NoSuchUpload(f"upload {upload.upload_id!r} does not exist")
            old = self.get(upload.bucket, obj.key)
            if expect is not None:
                expect(old)
            dropped = Dropped()
            for p in self.parts(upload.upload_id):
                dropped.add([] if p.part in used else p.blocks, p.record)
            found = self.upload(upload.upload_id)
            dropped.add([], found.record if found is not None else "")
            db.execute("DELETE FROM parts WHERE upload_id = ?", (upload.upload_id,))
            db.execute("DELETE FROM uploads WHERE upload_id = ?", (upload.upload_id,))
            db.execute("DELETE FROM completed WHERE completed_ns < ?", (obj.mtime_ns - COMPLETED_KEPT_NS,))
            db.execute(
                "INSERT OR REPLACE INTO completed VALUES (?, ?, ?, ?, ?)",
                (upload.upload_id, upload.bucket, obj.key, obj.etag, obj.mtime_ns),
            )
            self._insert_object(db, upload.bucket, obj)
            if old is not None:
                dropped.add(old.blocks, old.record)
            return dropped

        return self._tx(tx)

    # -- housekeeping -------------------------------------------------------------

    def referenced(self, buckets: list[str]) -> set[str]:
        """Every block key the objects and parts of ``buckets`` use."""
        out: set[str] = set()
        for name in buckets:
            for (text,) in self._db.execute("SELECT blocks FROM objects WHERE bucket = ?", (name,)):
                out.update(k for k, _ in _extents(text))
            for (text,) in self._db.execute(
                "SELECT p.blocks FROM parts p JOIN uploads u ON p.upload_id = u.upload_id WHERE u.bucket = ?", (name,)
            ):
                out.update(k for k, _ in _extents(text))
        return out

    def forget_bucket(self, name: str) -> None:
        """Drop a bucket of a deleted tenant (its blocks and records went
        with the tenant)."""
        self.delete_bucket(name, only_if_empty=False)

    # -- recovery (see recovery.py) -------------------------------------------------

    def records_of(self, bucket: str) -> list[str]:
        """The record keys the bucket's rows name: its own, its objects',
        its uploads' and their parts'."""
        out = [r[0] for r in self._db.execute("SELECT record FROM buckets WHERE name = ?", (bucket,))]
        out += [r[0] for r in self._db.execute("SELECT record FROM objects WHERE bucket = ?", (bucket,))]
        out += [r[0] for r in self._db.execute("SELECT record FROM uploads WHERE bucket = ?", (bucket,))]
        out += [
            r[0]
            for r in self._db.execute(
                "SELECT p.record FROM parts p JOIN uploads u ON p.upload_id = u.upload_id WHERE u.bucket = ?",
                (bucket,),
            )
        ]
        return [r for r in out if r]

    def uploads_of(self, bucket: str) -> list[Upload]:
        rows = self._db.execute(f"SELECT {_UPLOAD_COLS} FROM uploads WHERE bucket = ?", (bucket,)).fetchall()
        return [_upload(r) for r in rows]

    def set_records(self, named: list[tuple[str, tuple[Any, ...], str]]) -> None:
        """Name the records just written for rows that had none: (table,
        the row's key, the record's key), in one transaction."""
        where = {
            "buckets": "name = ?",
            "objects": "bucket = ? AND key = ?",
            "uploads": "upload_id = ?",
            "parts": "upload_id = ? AND part = ?",
        }

        def tx(db: sqlite3.Connection) -> None:
            for table, ident, record in named:
                db.execute(f"UPDATE {table} SET record = ? WHERE {where[table]}", (record, *ident))

        self._tx(tx)

    def load(
        self,
        buckets: list[Bucket],
        objects: list[tuple[str, ObjectRow]],
        uploads: list[Upload],
        parts: list[tuple[str, PartRow]],
    ) -> None:
        """Replace every row but ``completed`` with these (a rebuild), in one
        transaction."""

        def tx(db: sqlite3.Connection) -> None:
            for table in _TABLES:
                db.execute(f"DELETE FROM {table}")
            for b in buckets:
                db.execute(
                    "INSERT INTO buckets VALUES (?, ?, ?, ?, ?, ?)",
                    (b.name, b.tenant, b.incarnation, b.created_ns, b.region, b.record),
                )
            for bucket, obj in objects:
                self._insert_object(db, bucket, obj)
            for upload in uploads:
                self._insert_upload(db, upload)
            for upload_id, part in parts:
                self._insert_part(db, upload_id, part)

        self._tx(tx)
