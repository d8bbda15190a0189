"""The weighted fair gate a worker's bulk transfers pass.

A worker moves at most ``slots`` bulk transfers at once (its bulk reads for
their whole request, its block writes for their store once the body is in:
kvstore/transport/http/qos.py). While a slot is free and nobody
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

No tenant holds more than its share of the slots: its weight's part of them
among the tenants in the gate (holding or waiting), never more than three
quarters (more only while a quarter stays free: shares.py). So a tenant that
arrives finds a slot free however many transfers another has queued, and
under saturation each tenant's slots, like its bytes, follow its weight.

One gate per worker, on its event loop (no lock). With several workers each
shares its own connections by weight; the node-wide limits are buckets.py's.
"""

from __future__ import annotations

import asyncio
from collections import deque

from kvstore.qos.shares import HEADROOM, within_share

REQUEST_COST = 64 << 10  # what a transfer costs beside its bytes: a tenant of many small requests is not free


class FairGate:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.busy = 0
        self.held: dict[str, int] = {}  # tenant -> slots it holds
        self._weight: dict[str, int] = {}  # tenant -> its weight, as last given
        self._vtime = 0.0
        self._finish: dict[str, float] = {}  # tenant -> virtual time of the service charged to it
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._alone = max(1, slots - int(slots * HEADROOM))  # the share of a tenant alone in the gate

    def waiting(self, tenant: str) -> int:
        q = self._waiting.get(tenant)
        return len(q) if q else 0

    def charge(self, tenant: str, weight: int, n: int) -> None:
        """``n`` bytes moved for ``tenant``: its virtual time advances by ``n / weight``."""
        self._finish[tenant] = self._finish.get(tenant, self._vtime) + n / weight

    def _activate(self, tenant: str) -> None:
        """A tenant with nothing in the gate arrives: it starts from the gate's
        virtual time if it is behind (idling earns no credit)."""
        if tenant not in self.held and tenant not in self._waiting:
            self._finish[tenant] = max(self._finish.get(tenant, self._vtime), self._vtime)

    def share(self, tenant: str) -> int:
        """The slots ``tenant`` may hold: its weight's part among the tenants
        in the gate, at least one, at most all but HEADROOM of them."""
        held = self.held
        if not self._waiting and (not held or (len(held) == 1 and tenant in held)):
            return self._alone  # the only tenant in the gate (the usual case: no sets, no sums)
        active = held.keys() | self._waiting.keys() | {tenant}
        total = sum(self._weight.get(t, 100) for t in active)
        part = int(self.slots * self._weight.get(tenant, 100) / total)
        return max(1, min(part, self.slots - int(self.slots * HEADROOM)))

    def _may_take(self, tenant: str) -> bool:
        """A slot is free and within ``tenant``'s share; or past its share
        while HEADROOM stays free, and no other tenant is waiting for one."""
        if self.busy >= self.slots:
            return False
        held, share = self.held.get(tenant, 0), self.share(tenant)
        if held + 1 <= share:
            return True
        others_wait = len(self._waiting) > (tenant in self._waiting)
        return not others_wait and within_share(held, 1, share, self.busy, self.slots)

    def try_enter(self, tenant: str, weight: int) -> bool:
        """Take a slot now if one is free for ``tenant`` (the fast lane's way:
        it never waits). Tenants still waiting then are past their share
        (every change grants what it can), so this jumps no turn."""
        self._weight[tenant] = weight
        if not self._may_take(tenant):
            return False
        self._enter(tenant, weight)
        return True

    def _take(self, tenant: str) -> None:
        self.busy += 1
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def _enter(self, tenant: str, weight: int) -> None:
        self._activate(tenant)
        self._take(tenant)
        self._charge_entry(tenant, weight)

    async def enter(self, tenant: str, weight: int, timeout_s: float) -> bool:
        """Take a slot, waiting for one at most ``timeout_s``; False if none came."""
        if self.try_enter(tenant, weight):
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._activate(tenant)
        self._waiting.setdefault(tenant, deque()).append(fut)
        self._grant()  # (a slot may be free, held back only from tenants past their share)
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
                self.leave(tenant)
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

    def leave(self, tenant: str) -> None:
        """``tenant``'s transfer ended: its slot goes to whoever is next."""
        self.busy -= 1
        left = self.held[tenant] - 1
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]
        self._grant()

    def _grant(self) -> None:
        """Free slots to the waiting tenants, within their shares, served least for their weight."""
        while self.busy < self.slots and self._waiting:
            ready = [t for t in self._waiting if self._may_take(t)]
            if not ready:
                return
            tenant = min(ready, key=lambda t: self._finish.get(t, self._vtime))
            q = self._waiting[tenant]
            fut = q.popleft()
            if not q:
                del self._waiting[tenant]
            self._take(tenant)
            self._vtime = max(self._vtime, self._finish.get(tenant, self._vtime))
            fut.set_result(None)
