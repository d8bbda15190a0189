"""Bring the gateway's catalog in line with its records when the gateway starts.

Rules (the records, :mod:`.records`, are what survives the disk; the
catalog is the truth while the disk lives):

- A catalog that is new (a node rebuilt from its bucket, a first start) or
  whose rebuild did not finish (state :data:`~.catalog.REBUILDING`) is
  rebuilt from the records of every tenant, read through the store (from the
  object tier where a segment is only there). Where two versions of an
  object name the same (bucket, key) (a crash between writing the new
  record and deleting the old one), the newer wins; where two tenants'
  records name the same bucket (a deletion that was not flushed before the
  disk was lost), a sealed tenant's (authenticated) wins over a direct
  one's, then the newer; objects whose blocks are gone are
  left out; an upload whose parts an object uses was completed. A bucket
  that objects or uploads name but whose own record is gone (its TTL, its
  quota) is made again. What loses is deleted.
- A record that cannot be read for a reason a retry could fix (the object
  tier unreachable) leaves the rebuild unfinished: the catalog serves what
  was read, nothing is deleted, no orphan is swept, and the next start
  rebuilds again from the records (every change made meanwhile wrote one).
  A record that is not the gateway's (damaged, or written over ``/v1`` under
  the reserved prefix: for a sealed tenant, one the gateway did not seal)
  is skipped and deleted. A record in a newer format (a later release
  wrote it) stops the rebuild and the gateway's start, deleting nothing.
- A catalog that is :data:`~.catalog.MIRRORED` (or :data:`~.catalog.LEGACY`,
  made before records existed) is the truth: records it does not name (a
  crash before its commit) are deleted; a row whose record is missing (never
  written, or removed by the tenant's quota or TTL) gets it written.
- A node that serves another node's bucket read-only (``s3_readonly``)
  rebuilds its catalog from the records at every start, and changes nothing.
- Only then, and only when this finished, does the orphan sweep of objects'
  blocks run (:func:`~.objects.sweep_orphans`): every block a surviving
  record names is in the catalog by then.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.buckets import records
from kvstore.buckets.catalog import MIRRORED, REBUILDING, Bucket, Catalog, ObjectRow, PartRow, Upload
from kvstore.buckets.objects import new_uid
from kvstore.buckets.records import BucketRecord, ObjectRecord, PartRecord, Record, UploadRecord
from kvstore.engine.api import Store
from kvstore.errors import CorruptionError, KVStoreError, NewerFormat, NotFound

log = logging.getLogger("kvstore.s3")
T = TypeVar("T")

READ_AT_ONCE = 32  # records read in parallel (ranged GETs where a segment is only in the object tier)
READ_ATTEMPTS = 4  # of a record whose read fails in a way a retry can fix
PAGE = 1000


@dataclass(slots=True)
class Report:
    rebuilt: bool = False
    complete: bool = True  # False: a rebuild left unfinished (nothing deleted; rebuilt again next start)
    read: int = 0
    unreadable: int = 0
    written: int = 0
    deleted: int = 0
    buckets: int = 0
    objects: int = 0
    uploads: int = 0
    parts: int = 0


async def recover(store: Store, catalog: Catalog, region: str) -> Report:
    """Rebuild the catalog from the records, or reconcile the records with
    the catalog (see the module's docstring); what was done."""
    for b in await catalog.run(catalog.all_buckets):
        if store.incarnation(b.tenant) != b.incarnation:  # its tenant was deleted, its records with it
            await catalog.run(catalog.forget_bucket, b.name)
    if store.adopted:  # a node serving another's bucket read-only: its records are the truth, at every start
        report = await _rebuild(store, catalog, region, writable=False)
        report.complete = False
        return report
    if await catalog.run(lambda: catalog.state) == REBUILDING:
        report = await _rebuild(store, catalog, region)
    else:
        report = await _reconcile(store, catalog)
    if report.complete:
        await catalog.run(catalog.set_state, MIRRORED)
    else:
        log.error(
            "the S3 gateway's catalog was rebuilt only in part (records unreadable for now): nothing is deleted and "
            "orphans are not swept; it is rebuilt again at the next start"
        )
    if report.read or report.written or report.deleted or report.unreadable:
        log.warning(
            "S3 gateway catalog %s: %d buckets, %d objects, %d uploads, %d parts; %d records read, %d written, "
            "%d deleted, %d unreadable",
            "rebuilt from its records" if report.rebuilt else "reconciled with its records",
            report.buckets,
            report.objects,
            report.uploads,
            report.parts,
            report.read,
            report.written,
            report.deleted,
            report.unreadable,
        )
    return report


async def _record_keys(store: Store) -> dict[str, list[str]]:
    """Every tenant's record keys (expired ones left out)."""
    out: dict[str, list[str]] = {}
    for t in store.tenants():
        name = str(t["name"])
        keys: list[str] = []
        after: str | None = None
        while True:
            page, after = await store.list_keys(name, prefix=records.PREFIX, start_after=after, limit=PAGE)
            keys += [k for k, _ in page if records.kind_of(k) is not None]
            if after is None:
                break
        out[name] = keys
    return out


async def _bounded(jobs: list[Callable[[], Awaitable[T]]]) -> list[T | BaseException]:
    gate = asyncio.Semaphore(READ_AT_ONCE)

    async def one(job: Callable[[], Awaitable[T]]) -> T:
        async with gate:
            return await job()

    return list(await asyncio.gather(*(one(j) for j in jobs), return_exceptions=True))


async def _read(store: Store, tenant: str, key: str) -> Record | None:
    """The record under ``key``; None if it is gone. Retries what a retry
    can fix; :class:`CorruptionError` if it is not the gateway's."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return records.decode(store, tenant, key, await store.get(tenant, key))
        except NotFound:
            return None
        except CorruptionError:
            raise
        except KVStoreError as e:
            if not e.retryable or attempt + 1 == READ_ATTEMPTS:
                raise
            await asyncio.sleep(0.2 * 4**attempt)
    raise AssertionError("unreachable")


@dataclass(slots=True)
class _Claim:
    tenant: str
    created_ns: int
    region: str
    record: str  # "": none (the bucket's record is gone: one is written)


@dataclass(slots=True)
class _Tenant:
    """One tenant's records, by kind (record key, record)."""

    buckets: list[tuple[str, BucketRecord]] = field(default_factory=list)
    objects: list[tuple[str, ObjectRecord]] = field(default_factory=list)
    uploads: list[tuple[str, UploadRecord]] = field(default_factory=list)
    parts: list[tuple[str, PartRecord]] = field(default_factory=list)


async def _rebuild(store: Store, catalog: Catalog, region: str, writable: bool = True) -> Report:
    report = Report(rebuilt=True)
    found: dict[str, _Tenant] = {}
    doomed: dict[str, list[str]] = {}  # tenant -> record keys to delete once the rebuild is whole
    for tenant, keys in (await _record_keys(store)).items():
        mine = found[tenant] = _Tenant()
        lose = doomed[tenant] = []
        results = await _bounded([functools.partial(_read, store, tenant, k) for k in keys])
        for key, got in zip(keys, results, strict=True):
            if isinstance(got, NewerFormat):
                raise got  # written by a later release: the gateway stops here, deleting nothing
            if isinstance(got, CorruptionError):
                log.warning("skipped gateway record %s of tenant %s: %s", key, tenant, got)
                report.unreadable += 1
                lose.append(key)
            elif isinstance(got, KVStoreError):
                log.error("could not read gateway record %s of tenant %s: %s", key, tenant, got.code)
                report.complete = False
            elif isinstance(got, BaseException):
                raise got
            elif got is not None:
                report.read += 1
                _file(mine, key, got)

    # Buckets: one claim per (tenant, name), the newest; then one tenant per name, the newest.
    claims: dict[str, list[_Claim]] = {}
    for tenant, mine in found.items():
        newest: dict[str, _Claim] = {}
        for key, b in sorted(mine.buckets, key=lambda kb: (kb[1].created_ns, kb[0])):
            if b.name in newest:
                doomed[tenant].append(newest[b.name].record)
            newest[b.name] = _Claim(tenant, b.created_ns, b.region, key)
        first: dict[str, int] = {}  # bucket -> its oldest object or upload, for a bucket whose record is gone
        for name, when in [(o.bucket, o.mtime_ns) for _, o in mine.objects] + [
            (u.bucket, u.created_ns) for _, u in mine.uploads
        ]:
            first[name] = min(when, first.get(name, when))
        for name, when in first.items():
            if name not in newest:
                newest[name] = _Claim(tenant, when, region, "")
        for name, claim in newest.items():
            claims.setdefault(name, []).append(claim)
    # A sealed tenant's records are authenticated (sealed under its data key
    # by the gateway); a direct tenant's are plaintext anyone with its token
    # could have written over /v1: a sealed claim wins over a direct one.
    sealed = {str(t["name"]) for t in store.tenants() if t["policy"] == "sealed"}
    owner: dict[str, _Claim] = {}
    for name, those in claims.items():
        ranked = sorted(those, key=lambda c: (c.tenant in sealed, c.created_ns, c.tenant))
        owner[name] = ranked[-1]
        if len(ranked) > 1:
            log.warning(
                "bucket %s is named by the records of tenants %s: %s's is kept (sealed first, then the newest)",
                name,
                ", ".join(c.tenant for c in ranked),
                ranked[-1].tenant,
            )
        for c in ranked[:-1]:
            if c.record:
                doomed[c.tenant].append(c.record)

    buckets: list[Bucket] = []
    for name, claim in sorted(owner.items()):
        incarnation = store.incarnation(claim.tenant)
        if incarnation is None:
            continue
        bucket = Bucket(name, claim.tenant, incarnation, claim.created_ns, claim.region, claim.record)
        if not claim.record and writable:  # made again from its objects: its record too
            key = records.key_of(records.BUCKET, new_uid())
            try:
                await records.put(store, claim.tenant, key, records.of_bucket(bucket))
                bucket = Bucket(name, claim.tenant, incarnation, claim.created_ns, claim.region, key)
                report.written += 1
            except KVStoreError as e:
                log.warning("could not write the record of bucket %s again: %s", name, e.code)
        buckets.append(bucket)

    objects: list[tuple[str, ObjectRow]] = []
    uploads: list[Upload] = []
    parts: list[tuple[str, PartRow]] = []
    upload_ids: set[str] = set()  # one namespace, as bucket names are
    for tenant, mine in sorted(found.items()):
        lose = doomed[tenant]

        def owned(bucket: str, tenant: str = tenant) -> bool:
            return bucket in owner and owner[bucket].tenant == tenant

        latest: dict[tuple[str, bytes], tuple[str, ObjectRecord]] = {}
        for key, o in sorted(mine.objects, key=lambda ko: (ko[1].mtime_ns, ko[0])):
            if not owned(o.bucket):
                lose.append(key)
                continue
            if (o.bucket, o.key) in latest:
                lose.append(latest[(o.bucket, o.key)][0])
            latest[(o.bucket, o.key)] = (key, o)
        block_keys = sorted({b for _, o in latest.values() for b, _ in o.blocks})
        present: set[str] = set()
        for i in range(0, len(block_keys), PAGE):
            page = block_keys[i : i + PAGE]
            present.update(k for k, p in zip(page, await store.present(tenant, page), strict=True) if p)
        used: set[str] = set()
        for key, o in latest.values():
            if any(b not in present for b, _ in o.blocks):  # evicted, expired: the object is gone
                lose.append(key)
                continue
            used.update(b for b, _ in o.blocks)
            row = ObjectRow(o.key, o.size, o.etag, o.mtime_ns, records.seal_meta(store, tenant, o.meta), o.blocks, key)
            objects.append((o.bucket, row))

        live: dict[str, tuple[str, UploadRecord]] = {}
        for key, u in sorted(mine.uploads, key=lambda ku: (ku[1].created_ns, ku[0])):
            if not owned(u.bucket) or u.upload_id in upload_ids:
                lose.append(key)
                continue
            if u.upload_id in live:
                lose.append(live[u.upload_id][0])
            live[u.upload_id] = (key, u)
        newest_part: dict[tuple[str, int], tuple[str, PartRecord]] = {}
        for key, p in sorted(mine.parts, key=lambda kp: (kp[1].mtime_ns, kp[0])):
            if p.upload_id not in live:
                lose.append(key)
                continue
            if (p.upload_id, p.part) in newest_part:
                lose.append(newest_part[(p.upload_id, p.part)][0])
            newest_part[(p.upload_id, p.part)] = (key, p)
        completed = {p.upload_id for _, p in newest_part.values() if any(b in used for b, _ in p.blocks)}
        for upload_id, (key, u) in live.items():
            if upload_id in completed:  # an object uses its parts: it was completed
                lose.append(key)
                continue
            meta = records.seal_meta(store, tenant, u.meta)
            uploads.append(Upload(u.upload_id, u.bucket, u.key, u.created_ns, meta, key))
            upload_ids.add(upload_id)
        for (upload_id, _), (key, p) in newest_part.items():
            if upload_id in completed:
                lose.append(key)
                continue
            parts.append((upload_id, PartRow(p.part, p.size, p.etag, p.mtime_ns, p.blocks, key)))
        await asyncio.sleep(0)

    await catalog.run(catalog.load, buckets, objects, uploads, parts)
    report.buckets, report.objects, report.uploads, report.parts = len(buckets), len(objects), len(uploads), len(parts)
    if report.complete and writable:
        for tenant, keys in doomed.items():
            await records.delete(store, tenant, keys)
            report.deleted += len(keys)
    return report


def _file(mine: _Tenant, key: str, rec: Record) -> None:
    if isinstance(rec, BucketRecord):
        mine.buckets.append((key, rec))
    elif isinstance(rec, ObjectRecord):
        mine.objects.append((key, rec))
    elif isinstance(rec, UploadRecord):
        mine.uploads.append((key, rec))
    else:
        mine.parts.append((key, rec))


async def _reconcile(store: Store, catalog: Catalog) -> Report:
    report = Report()
    named: dict[str, set[str]] = {}
    for bucket in await catalog.run(catalog.all_buckets):
        tenant = bucket.tenant
        mine = named.setdefault(tenant, set())
        todo: list[_Row] = [("buckets", (bucket.name,), bucket.record, functools.partial(records.of_bucket, bucket))]
        for upload in await catalog.run(catalog.uploads_of, bucket.name):
            make = functools.partial(_upload_record, store, tenant, upload)
            todo.append(("uploads", (upload.upload_id,), upload.record, make))
            report.uploads += 1
            for part in await catalog.run(catalog.parts, upload.upload_id):
                make_part = functools.partial(records.of_part, upload.upload_id, part)
                todo.append(("parts", (upload.upload_id, part.part), part.record, make_part))
                report.parts += 1
        await _restore(store, catalog, tenant, todo, mine, report)
        after: bytes | None = None
        while True:
            rows = await catalog.run(catalog.list_objects, bucket.name, after, b"", PAGE)
            if not rows:
                break
            todo = [("objects", (bucket.name, r.key), r.record, _maker(store, tenant, bucket.name, r)) for r in rows]
            await _restore(store, catalog, tenant, todo, mine, report)
            report.objects += len(rows)
            after = rows[-1].key
        report.buckets += 1
    for tenant, keys in (await _record_keys(store)).items():
        stray = [k for k in keys if k not in named.get(tenant, set())]
        if stray:
            await records.delete(store, tenant, stray)
            report.deleted += len(stray)
    return report


_Row = tuple[str, tuple[object, ...], str, Callable[[], Record]]  # table, the row's key, its record, the record's maker


def _upload_record(store: Store, tenant: str, u: Upload) -> Record:
    return records.of_upload(u, records.open_meta(store, tenant, u.meta))


def _object_record(store: Store, tenant: str, bucket: str, row: ObjectRow) -> Record:
    return records.of_object(bucket, row, records.open_meta(store, tenant, row.meta))


def _maker(store: Store, tenant: str, bucket: str, row: ObjectRow) -> Callable[[], Record]:
    return functools.partial(_object_record, store, tenant, bucket, row)


async def _restore(
    store: Store,
    catalog: Catalog,
    tenant: str,
    todo: list[_Row],
    named: set[str],
    report: Report,
) -> None:
    """Write the records of rows that have none, or whose record is gone
    (several at a time: they share group commits)."""
    keys = [record for _, _, record, _ in todo if record]
    present: set[str] = set()
    if keys:
        present = {k for k, p in zip(keys, await store.present(tenant, keys), strict=True) if p}
    missing = []
    for table, ident, record, make in todo:
        if record in present:
            named.add(record)
        else:
            missing.append((table, ident, record, record or records.key_of(_KIND[table], new_uid()), make))

    async def write(key: str, make: Callable[[], Record]) -> None:
        await records.put(store, tenant, key, make())

    results = await _bounded([functools.partial(write, key, make) for *_, key, make in missing])
    newly = []
    for (table, ident, record, key, _), got in zip(missing, results, strict=True):
        if isinstance(got, KVStoreError):
            log.warning("could not write a gateway record of tenant %s again: %s", tenant, got.code)
        elif isinstance(got, BaseException):
            raise got
        else:
            report.written += 1
            named.add(key)
            if not record:
                newly.append((table, ident, key))
    if newly:
        await catalog.run(catalog.set_records, newly)


_KIND = {"buckets": records.BUCKET, "objects": records.OBJECT, "uploads": records.UPLOAD, "parts": records.PART}
