"""Maintenance an operator (or a test) runs on demand: flush before a
drain, a compaction or eviction pass now, following a bucket now, a scrub;
and what the operator's status shows of the store: its space and the
object tier's upload backlog."""

from __future__ import annotations

from typing import Any

from kvstore.engine.compactor import CompactionReport
from kvstore.engine.store_core import StoreCore
from kvstore.engine.verify import VerifyReport, verify_segments
from kvstore.errors import FlushIncomplete, InvalidInput


class StoreMaintenance(StoreCore):
    async def flush(self, upload_timeout_s: float = 0) -> dict[str, Any]:
        """Seal every open segment (each becomes immutable, with its footer);
        with an object tier, then wait up to ``upload_timeout_s`` until every
        sealed segment (and the registry) is in it: what an operator runs
        before draining a node. Raises :class:`FlushIncomplete` on timeout."""
        self._check_writable()
        for app in list(self._appenders.values()):
            await app.seal()
        mirror = self._residency.mirror
        if mirror is None:
            return {"flushed": True, "tier": None}
        mirror.kick()
        if not await mirror.wait_drained(upload_timeout_s):
            n, nbytes = mirror.backlog
            raise FlushIncomplete(
                f"{n} sealed segments ({nbytes} bytes) are not in the object tier yet after {upload_timeout_s:g} s; "
                "they stay queued (and local) and keep being retried"
            )
        return {"flushed": True, "tier": "mirrored"}

    async def compact(self, tenant: str | None = None) -> CompactionReport:
        """Run a compaction pass now (over ``tenant``, or every tenant) and
        return what it did once it is done."""
        self._check_writable()
        if tenant is not None:
            self._tenant(tenant)
        return await self._compactor.compact(tenant)

    async def evict(self) -> int:
        """Run one eviction pass now (normally the evictor runs it)."""
        self._check_open()
        return await self._residency.evict()

    async def follow_bucket(self) -> int:
        """A node adopting a bucket read-only: pick up the owner's changes now
        (normally every ``s3_refresh_s``). Returns how many segments were added."""
        self._check_open()
        if not self.adopted:
            raise InvalidInput("follow_bucket is for a node started with s3_readonly")
        return await self._residency.follow_bucket()

    async def verify(self, deep: bool = False) -> VerifyReport:
        """Scrub every segment: headers, footers, frame checksums; ``deep`` also
        opens every live frame (GCM tags, decompression)."""
        self._check_open()
        report = await self._run(verify_segments, self._seg_root, self._registry, self._index, deep)
        if report.errors:
            # The damage found is read again, and reported, by the next read
            # of it here and in every reader worker (verified.py).
            self._cache.forget_verified({segment for segment, _, _ in report.errors})
            await self._run(self._index.bump_epoch)
        return report

    def space(self) -> dict[str, Any]:
        """The data directory's space as the store measures it against its
        watermarks: its filesystem as statvfs reports it (``capacity`` 0;
        one system call, no scan), else the segment files' bytes against
        ``capacity``. ``full``: writes are refused for space (residency.py)."""
        self._check_open()
        residency, cfg = self._residency, self.config
        usage = residency.space.usage()
        return {
            "path": str(cfg.data_dir),
            "measured": "capacity" if cfg.capacity else "filesystem",
            "used_bytes": usage.used,
            "capacity_bytes": usage.capacity,
            "high_watermark": cfg.high_watermark,
            "full": residency.full,
        }

    def object_tier_state(self) -> dict[str, Any] | None:
        """Whether the object tier answers this node, as the last call to it
        found: ``{"reachable": true}``, or false with ``since`` (Unix time
        of the first failure) and ``error``; None where this process
        uploads nothing (no object tier, a reader worker, a read-only
        adopter). A node whose tier does not answer serves its local data
        and uploads once it does."""
        mirror = self._residency.mirror
        if mirror is None:
            return None
        if mirror.unreachable is None:
            return {"reachable": True}
        since, error = mirror.unreachable
        return {"reachable": False, "since": round(since, 3), "error": error}

    def upload_backlog(self) -> tuple[int, int] | None:
        """Sealed segments, and their bytes, not yet in the object tier;
        None where this process uploads nothing (no object tier, a reader
        worker, a node adopting a bucket read-only)."""
        mirror = self._residency.mirror
        return None if mirror is None else mirror.backlog
