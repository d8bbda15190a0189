"""The engine's types that its users see: what a read, a lookup, a plan or a
put answers. Transports import them (with the store) from kvstore.engine.api."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvstore.engine import reader
from kvstore.engine.format import REC_FLAG_SEALED
from kvstore.engine.index import IndexEntry
from kvstore.engine.segment import SegmentFile


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A stored block as a HEAD answers it. ``entry`` is where the engine
    found it: given back to a read in the same request
    (``Store.get_sendable(..., info=)``) it saves a second index lookup."""

    key: str
    size: int
    etag: str  # strong: names the stored record, unique per write
    created_ns: int
    stored_bytes: int
    sealed: bool
    key_version: int
    entry: IndexEntry | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, key: str, e: IndexEntry) -> BlockInfo:
        return cls(
            key,
            e.logical_size,
            e.record_id.hex(),
            e.created_ns,
            e.record_len,
            bool(e.flags & REC_FLAG_SEALED),
            e.key_version,
            e,
        )


@dataclass(frozen=True, slots=True)
class Stored:
    """What a put did: ``created`` (False: the key existed and nothing was
    written; the first write wins) and the block as it is stored now."""

    created: bool
    info: BlockInfo


@dataclass(frozen=True, slots=True)
class DirectExtent:
    """Verified bytes of a direct block in a local segment file, which stays
    open until :meth:`release`: sent with sendfile from ``segment.fd`` at
    ``offset``; ``view`` holds the same bytes in the segment's mapping, for
    what sendfile does not take."""

    segment: SegmentFile
    offset: int
    view: memoryview

    def release(self) -> None:
        self.segment.release()


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """Bytes [start, end) of a block as stored: ``frames`` says which frames
    and how to open them; ``body`` holds their stored bytes (a local
    segment's extent, sent with sendfile, or a record fetched from the
    object tier). Release it once sent."""

    start: int
    end: int
    frames: reader.StoredFrames
    body: DirectExtent | memoryview

    def release(self) -> None:
        if isinstance(self.body, DirectExtent):
            self.body.release()


@dataclass(frozen=True, slots=True)
class PlannedBlock:
    """Where a block's bytes are, for a client on this host to read itself:
    ``segment`` (acquired: the caller passes its descriptor on, then
    releases it) holds them at ``offset``. A direct block's frames of
    ``frame_size`` bytes (the last may be shorter) have their xxh3-64 in
    ``checksums``; a sealed block's stored frames start at ``offset`` and
    ``record`` says how to open them (the client decodes them itself)."""

    key: str
    segment: SegmentFile
    file: tuple[str, int, int]  # tenant, incarnation, segment id: names the file
    offset: int
    size: int
    frame_size: int
    checksums: tuple[int, ...]
    record: reader.StoredFrames | None = None


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix: int  # how many keys, from the start of the chain, are present
    present: list[bool]

    def only(self, keys: Sequence[str], kept: Collection[str]) -> LookupResult:
        """The same answer with the keys outside ``kept`` absent (found by
        the lookup, gone before a lock could pin them)."""
        present = [p and k in kept for k, p in zip(keys, self.present, strict=True)]
        return LookupResult(next((i for i, p in enumerate(present) if not p), len(present)), present)


@dataclass(frozen=True, slots=True)
class TenantStats:
    blocks: int
    stored_bytes: int
    logical_bytes: int
