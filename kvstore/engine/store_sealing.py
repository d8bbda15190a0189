"""Sealing before a segment is full, so that what a node loses is bounded in time.

Only sealed segments are mirrored to the object tier, and only mirrored
blocks outlive their node (the fleet's survivors serve them from the bucket,
docs/fleet.md). A segment is sealed when it is full (``segment_size``), on
``POST /v1/admin/flush``, and here:

- **By age** (:meth:`StoreSealing.sealer`): with ``seal_after_s`` on, the
  writer seals each persistent tenant's open segment once its oldest
  unsealed record is ``seal_after_s`` old; the mirror then uploads it. A
  block acknowledged more than ``seal_after_s`` plus an upload before the
  node dies is in the bucket. An idle tenant has no open segment after its
  seal (the next segment is made by the next write), so a quiet node seals
  nothing: at most one segment per tenant written to per ``seal_after_s``.
- **At a stop** (:meth:`StoreSealing.seal_for_stop`, from ``Store.close``,
  which SIGTERM reaches): every persistent tenant's open segment is sealed
  and the upload backlog waited for, up to ``STOP_UPLOAD_TIMEOUT_S``,
  whatever ``seal_after_s``.

Ephemeral tenants are never sealed early: their segments are not mirrored.
A seal goes through the tenant's appender, in order with its writes (the
appender alone changes an open segment).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvstore.engine.mirror import Mirror
from kvstore.engine.registry import Tenant
from kvstore.engine.store_core import StoreCore
from kvstore.errors import KVStoreError, StoreClosed

log = logging.getLogger("kvstore.engine.store")

# How long a stop waits for the segments it sealed (and any upload backlog)
# to reach the object tier. The supervisor gives a worker shutdown_timeout_s
# (30 s: requests draining) + 10 s after SIGTERM before SIGKILL, so this
# leaves room for the rest of the close. What is not uploaded in time stays
# sealed on the local disk and is uploaded at the next start.
STOP_UPLOAD_TIMEOUT_S = 8.0
# A stop stops waiting once every upload left has failed this many times:
# an unreachable tier is not waited out for the whole timeout.
STOP_UPLOAD_TRIES = 3
# The sealer looks for newly opened segments this often at most (a quarter
# of seal_after_s below 4 s): always before their seal is due.
SEALER_POLL_S = 1.0


class StoreSealing(StoreCore):
    def _early_seal_candidates(self) -> list[tuple[Tenant, float]]:
        """(tenant, when its oldest unsealed record was written) for each
        persistent tenant whose open segment holds unsealed records."""
        out = []
        for name, tail in list(self._tails.items()):
            since = tail.unsealed_since
            if since is None or tail.segment is None or name in self._deleting or name not in self._registry:
                continue
            t = self._registry.get(name)
            if t.durability == "persistent":
                out.append((t, since))
        return out

    async def seal_aged(self, older_than_s: float) -> list[tuple[str, int]]:
        """Seal the open segment of each persistent tenant whose oldest
        unsealed record was written at least ``older_than_s`` seconds ago
        (the mirror uploads it); returns the (tenant, segment id) sealed.
        Sets ``kvstore_unsealed_oldest_seconds`` to the age of the oldest
        unsealed record left."""
        self._check_writable()
        sealed: list[tuple[str, int]] = []
        for t, since in self._early_seal_candidates():
            if time.monotonic() - since < older_than_s:
                continue
            sid = await self._appender(t).seal()
            if sid is not None:
                sealed.append((t.name, sid))
                self.metrics.inc("kvstore_segments_sealed_early_total", reason="age")
        now = time.monotonic()
        left = [now - since for _, since in self._early_seal_candidates()]
        self.metrics.set("kvstore_unsealed_oldest_seconds", max(left, default=0.0))
        return sealed

    async def sealer(self, seal_after_s: float) -> None:
        """The writer's background task, until the store closes: it wakes
        when the oldest unsealed record turns ``seal_after_s`` old, and at
        least every quarter of ``seal_after_s`` (``SEALER_POLL_S`` at most)
        to notice segments opened since, so each seal comes on time, not a
        poll late; then :meth:`seal_aged`. A fenced node seals nothing (its
        writes wait too)."""
        poll = min(SEALER_POLL_S, seal_after_s / 4)
        failing = False
        while True:
            oldest = min((since for _, since in self._early_seal_candidates()), default=None)
            due = poll if oldest is None or failing else oldest + seal_after_s - time.monotonic()
            await asyncio.sleep(min(poll, max(0.01, due)))  # failing (fenced, a full disk): every poll
            try:
                await self.seal_aged(seal_after_s)
            except StoreClosed:
                return
            except (KVStoreError, OSError) as e:
                if not failing:
                    log.warning("sealing segments by age (seal_after_s = %g) failed: %s", seal_after_s, e)
                failing = True
                continue
            if failing:
                log.info("sealing segments by age works again")
            failing = False

    async def seal_for_stop(self, mirror: Mirror) -> None:
        """At a stop: seal every persistent tenant's open segment and wait,
        up to ``STOP_UPLOAD_TIMEOUT_S``, until the mirror has uploaded every
        sealed segment (and the registry); logged either way. Never raises:
        what is not uploaded stays sealed locally, queued for the next start."""
        t0 = time.monotonic()
        sealed = 0
        for t, _ in self._early_seal_candidates():
            try:
                sid = await self._appender_of(t).seal()
            except (KVStoreError, OSError) as e:
                log.error("stop: could not seal the open segment of tenant %s: %s", t.name, e)
                continue
            if sid is not None:
                sealed += 1
                self.metrics.inc("kvstore_segments_sealed_early_total", reason="stop")
        mirror.kick()
        if await mirror.wait_drained(STOP_UPLOAD_TIMEOUT_S, give_up_after=STOP_UPLOAD_TRIES):
            if sealed:
                log.info(
                    "stop: sealed %d open segments and the object tier has every sealed segment (%.2f s)",
                    sealed,
                    time.monotonic() - t0,
                )
            return
        n, nbytes = mirror.backlog
        if n == 0:  # only the registry's last change waits: it is rewritten at the next start
            log.warning(
                "stop: the tenant registry's last change is not in the object tier after %.1f s; it is uploaded "
                "at the next start",
                time.monotonic() - t0,
            )
            return
        log.error(
            "stop: %d sealed segments (%d bytes) are not in the object tier after %.1f s; they stay on the "
            "local disk and are uploaded at the next start (a node that never comes back loses them)",
            n,
            nbytes,
            time.monotonic() - t0,
        )
