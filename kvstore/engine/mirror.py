"""Background uploads to the object tier: sealed segments and the registry.

- Each sealed segment of a persistent tenant is queued once; ``concurrency``
  workers upload (the tier does multipart for large objects). Before an upload
  the object is looked up: one of the same size is ours from an upload whose
  confirmation was lost; one of another size is never overwritten (an error,
  kept in the backlog). After the upload a HEAD confirms the size, and only
  then does the index record the segment as mirrored. Nothing local may be
  dropped before that (space.py drops mirrored copies only).
- Failures keep the segment in the backlog and retry it after a backoff with
  full jitter (0.5 s doubling, capped), so an outage builds a backlog that
  drains when the tier is back; :meth:`Mirror.kick` retries at once.
- The registry (wrapped data keys, token hashes, policies) is uploaded after
  every change, newest version wins.
- A deleted tenant's objects are deleted in the background (they cannot be
  opened anyway: the tenant's keys are gone).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.engine.layout import REGISTRY_OBJECT
from kvstore.engine.lifecycle import Lifecycle, Phase
from kvstore.errors import TierError, TierUnavailable
from kvstore.metrics import Metrics
from kvstore.tasks import Background, wait_event
from kvstore.tier.base import Tier

log = logging.getLogger("kvstore.engine.mirror")
SegmentKey = tuple[str, int]
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 15.0


def backoff(attempt: int) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2 ** min(attempt, 16))))


@dataclass(slots=True)
class Upload:
    key: SegmentKey
    path: Path
    name: str  # object name
    size: int
    attempts: int = 0
    retry: asyncio.TimerHandle | None = None


class Mirror:
    def __init__(
        self,
        tier: Tier,
        lifecycle: Lifecycle,
        metrics: Metrics,
        run: Callable[..., Awaitable[Any]],
        registry_doc: Callable[[], bytes],
        concurrency: int,
        on_mirrored: Callable[[SegmentKey], None],
    ) -> None:
        self._tier = tier
        self._life = lifecycle
        self._metrics = metrics
        self._run = run
        self._registry_doc = registry_doc
        self._concurrency = concurrency
        self._on_mirrored = on_mirrored
        self._pending: dict[SegmentKey, Upload] = {}
        self._queue: asyncio.Queue[SegmentKey] = asyncio.Queue()
        self._tasks = Background()
        self._progress = asyncio.Event()
        self._registry_version = 0
        self._registry_uploaded = 0
        self._registry_wake = asyncio.Event()
        self._registry_attempts = 0
        # Since when, and why, the tier could not be reached (None: the last call went through).
        self.unreachable: tuple[float, str] | None = None
        self._loop = asyncio.get_running_loop()

    # -- life cycle -----------------------------------------------------------

    def start(self) -> None:
        self._reach_gauges()
        for i in range(self._concurrency):
            self._spawn(self._worker(), f"mirror-upload-{i}")
        self._spawn(self._registry_worker(), "mirror-registry")
        self._gauges()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.spawn(coro, name)

    async def close(self) -> None:
        for up in self._pending.values():
            if up.retry is not None:
                up.retry.cancel()
        await self._tasks.close()

    # -- what to upload -------------------------------------------------------

    def enqueue(self, key: SegmentKey, path: Path, name: str, size: int) -> None:
        if key in self._pending:
            return
        self._pending[key] = Upload(key, path, name, size)
        self._queue.put_nowait(key)
        self._gauges()

    def registry_changed(self) -> None:
        """Thread-safe: the registry file changed; upload the new version."""
        self._loop.call_soon_threadsafe(self._bump_registry)

    def _bump_registry(self) -> None:
        self._registry_version += 1
        self._registry_wake.set()

    def forget_tenant(self, tenant: str, prefix: str | None) -> None:
        """Stop uploading the tenant's segments; delete its objects under ``prefix``."""
        for key in [k for k in self._pending if k[0] == tenant]:
            up = self._pending.pop(key)
            if up.retry is not None:
                up.retry.cancel()
        self._gauges()
        self._progress.set()
        if prefix is not None:
            self.delete_prefix(prefix)

    def delete_prefix(self, prefix: str) -> None:
        self._spawn(self._delete_prefix(prefix), f"mirror-delete:{prefix}")

    @property
    def backlog(self) -> tuple[int, int]:
        """Segments and bytes waiting for upload."""
        return len(self._pending), sum(u.size for u in self._pending.values())

    def kick(self) -> None:
        """Retry every upload that waits out a backoff now (an operator's flush)."""
        for up in self._pending.values():
            if up.retry is not None:
                up.retry.cancel()
                up.retry = None
                self._queue.put_nowait(up.key)
        if self._registry_uploaded < self._registry_version:
            self._registry_wake.set()

    async def wait_drained(self, timeout: float, give_up_after: int = 0) -> bool:
        """True once nothing waits for upload (the registry included); False
        after ``timeout`` seconds, or, with ``give_up_after``, as soon as
        every upload still waiting has failed that many times (a stop does
        not wait out an unreachable tier)."""
        deadline = time.monotonic() + timeout
        while self._pending or self._registry_uploaded < self._registry_version:
            left = deadline - time.monotonic()
            if left <= 0 or (give_up_after and self._failing(give_up_after)):
                return False
            self._progress.clear()
            await wait_event(self._progress, min(left, 1.0))
        return True

    def _failing(self, tries: int) -> bool:
        """Whether every upload still waiting has failed ``tries`` times."""
        registry_waits = self._registry_uploaded < self._registry_version
        return all(up.attempts >= tries for up in self._pending.values()) and (
            not registry_waits or self._registry_attempts >= tries
        )

    # -- workers --------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            up = self._pending.get(key)
            if up is None or up.retry is not None:
                continue
            try:
                await self._upload(up)
            except TierError as e:
                self._failed(up, e)
                continue
            except OSError as e:
                self._failed(up, TierError(f"reading {up.path.name}: {e.strerror or e}"))
                continue
            self.reached(None)
            if self._pending.get(key) is up:
                del self._pending[key]
            self._metrics.inc("kvstore_tier_uploads_total")
            self._metrics.inc("kvstore_tier_upload_bytes_total", up.size)
            self._gauges()
            self._progress.set()
            self._on_mirrored(key)

    async def _upload(self, up: Upload) -> None:
        tenant, sid = up.key
        if await self._run(self._life.phase, tenant, sid) not in (Phase.SEALED, Phase.MIRRORED):
            return  # compacted (retired) or deleted meanwhile: nothing to upload
        info = await self._tier.head(up.name)
        if info is not None and info.size != up.size:
            raise TierError(
                f"object {up.name!r} exists with {info.size} bytes, not {up.size}: refusing to overwrite it"
            )
        if info is None:
            if not up.path.exists():
                raise TierError(f"local segment {up.path.name} is gone before its upload")
            t0 = time.perf_counter()
            await self._tier.put_file(up.name, up.path)
            self._metrics.observe("kvstore_tier_upload_seconds", time.perf_counter() - t0)
            info = await self._tier.head(up.name)
            if info is None or info.size != up.size:
                raise TierError(f"upload of {up.name!r} not confirmed: the object has {info and info.size} bytes")
        if self._pending.get(up.key) is not up:
            return  # the tenant was deleted meanwhile
        await self._run(self._life.mirrored, tenant, sid, up.size)

    def reached(self, e: TierError | None) -> None:
        """What the last call to the tier said: through (None), or an error;
        an unreachable tier is remembered from its first failure until a
        call goes through (the operator's status and ``/readyz`` show it,
        and ``kvstore_tier_reachable``)."""
        if e is None:
            if self.unreachable is not None:
                log.info("object tier reachable again (unreachable since %s)", _when(self.unreachable[0]))
                self.unreachable = None
                self._reach_gauges()
        elif isinstance(e, TierUnavailable) and self.unreachable is None:
            self.mark_unreachable(e)

    def mark_unreachable(self, e: TierError) -> None:
        """The tier does not answer (from now, until a call goes through)."""
        self.unreachable = (time.time(), str(e))
        self._reach_gauges()

    def _reach_gauges(self) -> None:
        since = 0.0 if self.unreachable is None else self.unreachable[0]
        self._metrics.set("kvstore_tier_reachable", 0 if self.unreachable else 1)
        self._metrics.set("kvstore_tier_unreachable_since_seconds", since)

    def _failed(self, up: Upload, e: TierError) -> None:
        self.reached(e)
        up.attempts += 1
        self._metrics.inc("kvstore_tier_errors_total", op="upload")
        delay = backoff(up.attempts)
        self._progress.set()  # a waiter that gives up on failures looks again
        if up.attempts == 1 or up.attempts % 10 == 0:
            log.warning("upload of %s failed (attempt %d, retrying in %.1fs): %s", up.name, up.attempts, delay, e)
        if self._pending.get(up.key) is not up:
            return

        def again() -> None:
            up.retry = None
            if self._pending.get(up.key) is up:
                self._queue.put_nowait(up.key)

        up.retry = self._loop.call_later(delay, again)

    async def _registry_worker(self) -> None:
        while True:
            await self._registry_wake.wait()
            self._registry_wake.clear()
            version = self._registry_version
            if self._registry_uploaded >= version:
                continue
            try:
                doc = await self._run(self._registry_doc)
                await self._tier.put_bytes(REGISTRY_OBJECT, doc)
            except (TierError, OSError) as e:
                if isinstance(e, TierError):
                    self.reached(e)
                self._registry_attempts += 1
                self._metrics.inc("kvstore_tier_errors_total", op="registry")
                self._progress.set()
                if self._registry_attempts == 1 or self._registry_attempts % 10 == 0:
                    log.warning("registry upload failed (attempt %d): %s", self._registry_attempts, e)
                self._loop.call_later(backoff(self._registry_attempts), self._registry_wake.set)
                continue
            self.reached(None)
            self._registry_attempts = 0
            self._registry_uploaded = max(self._registry_uploaded, version)
            self._progress.set()

    async def _delete_prefix(self, prefix: str) -> None:
        attempt = 0
        while True:
            try:
                names = [info.name async for info in self._tier.list(prefix)]
                for name in names:
                    await self._tier.delete(name)
                log.info("deleted %d objects under %s", len(names), prefix)
                return
            except TierError as e:
                attempt += 1
                self._metrics.inc("kvstore_tier_errors_total", op="delete")
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("deleting objects under %s failed (attempt %d): %s", prefix, attempt, e)
                await asyncio.sleep(backoff(attempt))

    def _gauges(self) -> None:
        n, nbytes = self.backlog
        self._metrics.set("kvstore_tier_upload_backlog_segments", n)
        self._metrics.set("kvstore_tier_upload_backlog_bytes", nbytes)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
