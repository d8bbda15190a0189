"""Data written by a newer kvstore is refused, named, and left as it is.

One test per persisted format (docs/operations.md, "Formats"): a segment
header, a record, the LMDB index, the tenant registry (a node's and the
fleet's), the S3 gateway's catalog and its records. Each puts a version
newer than this release reads where a later release would, opens it the
way the daemon does, and checks that the refusal names the version found,
the versions this release reads and the way on (upgrade, or restore), and
that not one byte of the data changed.

What used to happen: a segment header of another version was reported as
corruption and start-up went on without the segment; a record of another
version at the tail of an open segment passed for a torn tail and was cut
off; an index of another format was destroyed and rebuilt; a gateway record
of another version was skipped as damaged and deleted; the registry's
refusal ("tenant registry version 2 is not supported") gave no advice.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import sqlite3
import struct
import zlib
from pathlib import Path

import pytest

from kvstore.buckets import records
from kvstore.buckets.catalog import Catalog
from kvstore.buckets.recovery import recover as recover_catalog
from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.format import RECORD_HEADER, SEG_HEADER, VERSIONS_READ
from kvstore.engine.index import INDEX_FORMAT, INDEX_FORMATS_READ, Index
from kvstore.engine.registry import REGISTRY_VERSION, Registry, UnknownTenantSetting, adopt_registry_file
from kvstore.engine.segment import SegmentFile
from kvstore.engine.store import Store
from kvstore.errors import CorruptionError, NewerFormat

from ..conftest import OpenStore


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file of the data under ``root``: segments, the
    registry, the index's data (not the lock files LMDB and the store keep,
    nor the space reserve)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in ("LOCK", "lock.mdb", "reserve"):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_names_the_way_on(e: NewerFormat, found: int, reads: tuple[int, ...]) -> None:
    msg = str(e)
    assert e.code == "newer_format" and not isinstance(e, CorruptionError)
    assert f"format version {found}" in msg and "written by a newer kvstore" in msg, msg
    assert f"reads version{'s' if len(reads) > 1 else ''} {', '.join(map(str, reads))} only" in msg, msg
    assert "Upgrade kvstore" in msg and "restore" in msg and "nothing was changed" in msg, msg


async def _written(open_store: OpenStore, policy: str = "direct", n: int = 3) -> tuple[Store, list[str]]:
    s = await open_store()
    await s.create_tenant("t", policy)
    keys = [f"k{i}" for i in range(n)]
    for i, k in enumerate(keys):
        await s.put("t", k, bytes([i + 1]) * (5000 + i))
    return s, keys


def _segments(config: StoreConfig) -> list[Path]:
    return sorted((config.data_dir / "segments" / "t").glob("*.seg"))


# -- segments and records ----------------------------------------------------------


async def test_a_newer_segment_header_stops_start_up(open_store: OpenStore, config: StoreConfig) -> None:
    s, _ = await _written(open_store)
    await s.close()
    seg = _segments(config)[-1]
    raw = bytearray(seg.read_bytes())
    struct.pack_into("<H", raw, 8, max(VERSIONS_READ) + 1)
    struct.pack_into("<I", raw, SEG_HEADER.size - 4, zlib.crc32(bytes(raw[: SEG_HEADER.size - 4])))
    seg.write_bytes(raw)
    before = snapshot(config.data_dir)
    with pytest.raises(NewerFormat) as e:
        await open_store()
    assert_names_the_way_on(e.value, max(VERSIONS_READ) + 1, VERSIONS_READ)
    assert seg.name in str(e.value)
    assert snapshot(config.data_dir) == before


async def test_a_newer_record_at_the_tail_of_an_open_segment_is_not_cut_as_a_torn_tail(
    open_store: OpenStore, config: StoreConfig
) -> None:
    """It used to be: the index rebuilt, the record's version unknown, no
    valid record after it, so recovery cut it off as a torn tail."""
    s, _ = await _written(open_store)
    await s.close()
    seg_path = _segments(config)[-1]
    seg = SegmentFile.open(seg_path)
    last = [item.offset for item in seg.scan()][-1]
    seg.close()
    raw = bytearray(seg_path.read_bytes())
    raw[last + 4] = max(VERSIONS_READ) + 1
    (header_len,) = struct.unpack_from("<I", raw, last + 8)
    struct.pack_into("<I", raw, last + RECORD_HEADER.size - 4, 0)
    struct.pack_into("<I", raw, last + RECORD_HEADER.size - 4, zlib.crc32(bytes(raw[last : last + header_len])))
    seg_path.write_bytes(raw)
    shutil.rmtree(config.data_dir / "index")  # rebuilt from the segments: every record scanned
    before = snapshot(config.data_dir)
    with pytest.raises(NewerFormat) as e:
        await open_store()
    assert_names_the_way_on(e.value, max(VERSIONS_READ) + 1, VERSIONS_READ)
    assert f"offset {last}" in str(e.value)
    # The segments and the registry as they were; the index (a cache, absent
    # here) holds what the rebuild indexed before it met the record.
    assert {k: v for k, v in snapshot(config.data_dir).items() if not k.startswith("index/")} == before
    assert seg_path.stat().st_size == len(raw)


# -- the index ------------------------------------------------------------------------


def _set_index_format(path: Path, fmt: int) -> None:
    index = Index(path)
    meta = index.env.open_db(b"meta")  # outside the write transaction: open_db takes one of its own
    with index.env.begin(write=True) as txn:
        txn.put(b"format", struct.pack("<I", fmt), db=meta)
    index.close()


async def test_a_newer_index_is_refused_not_rebuilt(open_store: OpenStore, config: StoreConfig) -> None:
    s, _ = await _written(open_store)
    await s.close()
    _set_index_format(config.data_dir / "index", INDEX_FORMAT + 1)
    before = snapshot(config.data_dir)
    with pytest.raises(NewerFormat) as e:
        await open_store()
    assert_names_the_way_on(e.value, INDEX_FORMAT + 1, INDEX_FORMATS_READ)
    assert "remove" in str(e.value) and "rebuilds from the segments" in str(e.value)
    assert snapshot(config.data_dir) == before
    with pytest.raises(NewerFormat):  # a reader (fsck, a reader worker) too
        Index(config.data_dir / "index", readonly=True, lock=False)


async def test_a_format_2_index_is_migrated_in_place_keeping_its_access_times(
    open_store: OpenStore, config: StoreConfig
) -> None:
    """Format 2 (0.1.0's) lacks the access order (the order db): the writer
    builds it at start-up from the blocks and access dbs, in place; the
    access times survive, so the quota's LRU order does too."""
    s, keys = await _written(open_store, n=40)
    await asyncio.sleep(0.01)  # the order is by millisecond: k0's read after the last put's
    await s.get("t", "k0")
    await s.close()
    index = Index(config.data_dir / "index")
    before = index.oldest("t", None, 100)
    with index.env.begin(write=True) as txn:  # as 0.1.0 left it: no order, fresh or policy db
        for name in (b"order", b"fresh", b"policy"):
            txn.drop(index.env.open_db(name, txn=txn), delete=True)
    index.close()
    _set_index_format(config.data_dir / "index", 2)
    s = await open_store()
    assert not s.recovery.index_rebuilt
    index = s._index
    walked = index.oldest("t", None, 100)
    # (within one millisecond the order is by key: k10 may come before k9)
    assert walked == before, "the order is rebuilt as it was, access times included"
    assert sorted(k for _, k, _ in walked) == sorted(keys) and walked[-1][1] == "k0", "k0, read last, is the newest"
    with index.env.begin() as txn:
        assert struct.unpack("<I", txn.get(b"format", db=index.env.open_db(b"meta", txn=txn)))[0] == INDEX_FORMAT
    # the bytes on probation (every block but k0, read since stored) are counted at their first use
    entries = dict(index.entries("t", None, 100))
    assert index.fresh_bytes("t") == sum(e.record_len for k, e in entries.items() if k != "k0")
    for i, k in enumerate(keys):
        assert bytes(await s.get("t", k)) == bytes([i + 1]) * (5000 + i)


async def test_an_older_index_is_rebuilt_from_the_segments(open_store: OpenStore, config: StoreConfig) -> None:
    """Newer reads older: an index of a format before any this release
    reads is this release's migration of it: rebuilt from the segments."""
    s, keys = await _written(open_store)
    await s.close()
    _set_index_format(config.data_dir / "index", min(INDEX_FORMATS_READ) - 1)
    s = await open_store()
    assert s.recovery.index_rebuilt
    for i, k in enumerate(keys):
        assert bytes(await s.get("t", k)) == bytes([i + 1]) * (5000 + i)


# -- the tenant registry -----------------------------------------------------------------


def _bump_registry(path: Path) -> bytes:
    doc = json.loads(path.read_bytes())
    doc["version"] = REGISTRY_VERSION + 1
    raw = json.dumps(doc, indent=1, sort_keys=True).encode()
    path.write_bytes(raw)
    return raw


async def test_a_newer_registry_stops_start_up(open_store: OpenStore, config: StoreConfig, master: MasterKey) -> None:
    s, _ = await _written(open_store)
    await s.close()
    _bump_registry(config.data_dir / "registry.json")
    before = snapshot(config.data_dir)
    with pytest.raises(NewerFormat) as e:  # not "unknown tenants", which would offer to drop their data
        await open_store()
    assert_names_the_way_on(e.value, REGISTRY_VERSION + 1, (REGISTRY_VERSION,))
    assert "registry.json" in str(e.value)
    assert snapshot(config.data_dir) == before
    with pytest.raises(NewerFormat):
        Registry(config.data_dir / "registry.json", master, readonly=True)


@pytest.mark.parametrize(
    ("setting", "value"), [("policy", "sealed-v2"), ("compression", "lz4"), ("durability", "cold")]
)
async def test_an_unknown_tenant_setting_in_the_registry_stops_start_up(
    open_store: OpenStore, config: StoreConfig, master: MasterKey, setting: str, value: str
) -> None:
    # Used to be: an unknown policy was loaded unchecked, so a newer release's
    # policy read as "not sealed", and the tenant's next blocks went to disk in plaintext.
    s, _ = await _written(open_store, policy="sealed")
    await s.close()
    path = config.data_dir / "registry.json"
    doc = json.loads(path.read_bytes())
    (tenant,) = doc["tenants"].values()
    tenant[setting] = value
    path.write_text(json.dumps(doc))
    before = snapshot(config.data_dir)
    with pytest.raises(UnknownTenantSetting, match=f"has {setting} '{value}', which this kvstore"):
        await open_store()
    assert snapshot(config.data_dir) == before


async def test_a_newer_fleet_registry_is_not_adopted(
    open_store: OpenStore, config: StoreConfig, master: MasterKey, tmp_path: Path
) -> None:
    """``fleet/registry.json`` in the bucket is a registry document: a node
    takes it as its own only once it loads, at start-up and at each refresh."""
    s, _ = await _written(open_store)
    await s.close()
    mine = config.data_dir / "registry.json"
    fleet_copy = tmp_path / "fleet-registry.json"
    shutil.copy(mine, fleet_copy)
    newer = _bump_registry(fleet_copy)
    before = snapshot(config.data_dir)
    with pytest.raises(NewerFormat) as e:
        adopt_registry_file(mine, newer, master)
    assert_names_the_way_on(e.value, REGISTRY_VERSION + 1, (REGISTRY_VERSION,))
    assert snapshot(config.data_dir) == before


# -- the S3 gateway's catalog and records ----------------------------------------------------


def test_a_newer_gateway_catalog_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s3" / "catalog.sqlite3"
    Catalog(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=3")
    db.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(NewerFormat) as e:
        Catalog(path)
    assert_names_the_way_on(e.value, 3, (0, 1, 2))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


async def test_a_newer_gateway_record_stops_the_rebuild_and_is_kept(
    open_store: OpenStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to be: skipped as damaged, then deleted with the rebuild."""
    s = await open_store()
    await s.create_tenant("t", "sealed")
    key = records.key_of(records.BUCKET, "0" * 32)
    with monkeypatch.context() as m:
        m.setattr(records, "_VERSION", max(records.VERSIONS_READ) + 1)
        blob = records.encode(s, "t", key, records.BucketRecord("b1", "us-east-1", 1))
    await s.put("t", key, blob)
    with pytest.raises(NewerFormat) as e:
        records.decode(s, "t", key, blob)
    assert_names_the_way_on(e.value, max(records.VERSIONS_READ) + 1, records.VERSIONS_READ)
    catalog = Catalog(tmp_path / "catalog.sqlite3")  # new: rebuilt from the records
    try:
        with pytest.raises(NewerFormat):
            await recover_catalog(s, catalog, "us-east-1")
    finally:
        catalog.close()
    assert bytes(await s.get("t", key)) == blob
