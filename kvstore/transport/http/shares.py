"""Each tenant's share of what a worker holds for requests in progress.

A worker bounds the request bodies it holds in memory
(``max_buffered_body_bytes``, :class:`~kvstore.transport.http.bodies.BodyBudget`)
and its requests in flight (``max_concurrency``). Bounded only in total, one
tenant could hold all of either: PUTs that declare large bodies and send a
few bytes kept every other tenant's PUTs at ``503 overloaded`` until
``request_timeout_s``, and enough of them held every slot, so other tenants'
GETs failed too. Each tenant may hold its QoS weight's part of each among
the tenants holding some (:data:`TENANT_SHARE` while it is alone, or between
equal weights; of the body budget, one block's body at least), and more only
while :data:`HEADROOM` of it stays free for the other tenants: one tenant
alone may use most of a worker, and however it uses it, a tenant that
arrives finds room. Past that a
tenant's own requests get ``503 overloaded`` at once, saying so. Counted per
worker, on the event loop (no lock), by the routes and the fast lane alike.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from kvstore.errors import Overloaded
from kvstore.qos.policy import DEFAULT_WEIGHT
from kvstore.qos.shares import TENANT_SHARE, within_share


class Shares:
    """What each tenant holds of a worker's ``limit`` (bytes, or requests):
    each at most its share (:meth:`share`: TENANT_SHARE of it between equal
    weights, more for a heavier weight, ``floor`` at least), or more while
    HEADROOM of it stays free (:func:`within_share`)."""

    def __init__(self, limit: int, floor: int) -> None:
        self.limit = limit
        self.floor = min(floor, limit)
        self.per_tenant = max(int(limit * TENANT_SHARE), self.floor)  # between two tenants of equal weights
        self.held: dict[str, int] = {}
        # A tenant's QoS weight (kvstore/qos/policy.py; set by the worker's QoS, qos.py)
        self.weight_of: Callable[[str], int] = lambda tenant: DEFAULT_WEIGHT

    def share(self, tenant: str) -> int:
        """``tenant``'s share: its weight's part of the limit among the tenants
        holding some (TENANT_SHARE of it at most while it is alone, so that a
        tenant arriving finds room), ``floor`` at least."""
        w = self.weight_of(tenant)
        total = w + sum(self.weight_of(t) for t in self.held if t != tenant)
        part = self.limit * (TENANT_SHARE if total == w else w / total)
        return max(int(part), self.floor)

    def take(self, tenant: str, n: int, total: int) -> bool:
        """Count ``n`` more for ``tenant`` (``total`` in use by everyone), if its share allows."""
        held = self.held.get(tenant, 0)
        if not within_share(held, n, self.share(tenant), total, self.limit):
            return False
        self.held[tenant] = held + n
        return True

    def give(self, tenant: str, n: int) -> None:
        """``n`` of what ``tenant`` holds back."""
        if not n:
            return
        left = self.held[tenant] - n
        if left:
            self.held[tenant] = left
        else:
            del self.held[tenant]


class TenantSlots(Shares):
    """Requests in flight per tenant, each tenant within its share of ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit, floor=1)
        self.total = 0

    def acquire(self, tenant: str) -> None:
        if not self.take(tenant, 1, self.total):
            raise Overloaded(
                f"tenant {tenant!r} has {self.held[tenant]} requests in flight in this worker, past its share of"
                f" max_concurrency={self.limit} while the rest is kept for other tenants; retry"
            )
        self.total += 1

    def release(self, tenant: str) -> None:
        self.total -= 1
        self.give(tenant, 1)


SLOTS = web.AppKey("tenant_slots", TenantSlots)
