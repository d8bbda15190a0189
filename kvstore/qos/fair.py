"""The weighted fair gate a worker's bulk transfers pass.

A worker moves at most ``slots`` bulk transfers at once (GET and PUT of
blocks, batches, records, NIXL transfers). While a slot is free and nobody
waits, a transfer passes at once; when they are all taken, transfers wait,
and each slot that frees goes to the waiting tenant that has been served
least for its weight: each tenant's virtual time advances by what it moves
(bytes, and :data:`REQUEST_COST` per transfer) divided by its weight, and
the waiting tenant with the lowest goes next (start-time fair queueing, with
the service charged as it happens, so a tenant's bytes count whatever their
size). A tenant that was idle starts from the gate's virtual time, not from
its own old one: idling earns no credit. Under saturation tenants' bytes
follow their weights; a tenant with little traffic is next whenever it
arrives, whatever another tenant has queued.

One gate per worker, on its event loop (no lock). With several workers each
shares its own connections by weight; the node-wide limits are buckets.py's.
"""

from __future__ import annotations

import asyncio
from collections import deque

REQUEST_COST = 64 << 10  # what a transfer costs beside its bytes: a tenant of many small requests is not free


class FairGate:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = 0
        self._vtime = 0.0
        self._finish: dict[str, float] = {}  # tenant -> virtual time of the service charged to it
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    def waiting(self, tenant: str) -> int:
        q = self._waiting.get(tenant)
        return len(q) if q else 0

    def charge(self, tenant: str, weight: int, n: int) -> None:
        """``n`` bytes moved for ``tenant``: its virtual time advances by ``n / weight``."""
        self._finish[tenant] = max(self._finish.get(tenant, self._vtime), self._vtime) + n / weight

    def try_enter(self, tenant: str, weight: int) -> bool:
        """Take a slot now if one is free and nobody waits (the fast lane's way: it never waits)."""
        if self.busy >= self.slots or self._waiting:
            return False
        self._enter(tenant, weight)
        return True

    def _enter(self, tenant: str, weight: int) -> None:
        self.busy += 1
        start = max(self._finish.get(tenant, self._vtime), self._vtime)
        self._vtime = max(self._vtime, start)
        self._finish[tenant] = start + REQUEST_COST / weight

    async def enter(self, tenant: str, weight: int, timeout_s: float) -> bool:
        """Take a slot, waiting for one at most ``timeout_s``; False if none came."""
        if self.try_enter(tenant, weight):
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(fut)
        except TimeoutError:
            if fut.done():  # granted as the time ran out: keep it
                self._charge_entry(tenant, weight)
                return True
            self._forget(tenant, fut)
            return False
        except asyncio.CancelledError:
            if fut.done():  # granted, then the request went away: pass the slot on
                self.busy -= 1
                self._grant()
            else:
                self._forget(tenant, fut)
            raise
        self._charge_entry(tenant, weight)
        return True

    def _charge_entry(self, tenant: str, weight: int) -> None:
        self._finish[tenant] = self._finish.get(tenant, self._vtime) + REQUEST_COST / weight

    def _forget(self, tenant: str, fut: asyncio.Future[None]) -> None:
        q = self._waiting.get(tenant)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self._waiting[tenant]

    def leave(self) -> None:
        self.busy -= 1
        self._grant()

    def _grant(self) -> None:
        """Free slots to the waiting tenants served least for their weight."""
        while self.busy < self.slots and self._waiting:
            tenant = min(self._waiting, key=lambda t: self._finish.get(t, self._vtime))
            q = self._waiting[tenant]
            fut = q.popleft()
            if not q:
                del self._waiting[tenant]
            self.busy += 1
            self._vtime = max(self._vtime, self._finish.get(tenant, self._vtime))
            fut.set_result(None)
