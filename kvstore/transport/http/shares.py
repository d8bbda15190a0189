"""Each tenant's share of what a worker holds for requests in progress.

A worker bounds the request bodies it holds in memory
(``max_buffered_body_bytes``, :class:`~kvstore.transport.http.bodies.BodyBudget`)
and its requests in flight (``max_concurrency``). Bounded only in total, one
tenant could hold all of either: PUTs that declare large bodies and send a
few bytes kept every other tenant's PUTs at ``503 overloaded`` until
``request_timeout_s``, and enough of them held every slot, so other tenants'
GETs failed too. Each tenant may hold :data:`TENANT_SHARE` of each (of the
body budget, one block's body at least), and more only while :data:`HEADROOM`
of it stays free for the other tenants: one tenant alone may use most of a
worker, and however it uses it, a tenant that arrives finds room. Past that a
tenant's own requests get ``503 overloaded`` at once, saying so. Counted per
worker, on the event loop (no lock), by the routes and the fast lane alike.
"""

from __future__ import annotations

from aiohttp import web

from kvstore.errors import Overloaded

TENANT_SHARE = 0.5  # of a worker's body budget and of its requests in flight, per tenant
HEADROOM = 0.25  # of each, kept for the other tenants once a tenant is past its share


def within_share(held: int, n: int, share: int, total: int, limit: int) -> bool:
    """Whether a tenant that holds ``held`` of ``total`` in use may take ``n``
    more: within its ``share``, or past it while HEADROOM of ``limit`` stays free."""
    return held + n <= share or total + n <= limit - int(limit * HEADROOM)


class TenantSlots:
    """Requests in flight per tenant, each tenant at most its share of ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.per_tenant = max(1, int(limit * TENANT_SHARE))
        self.held: dict[str, int] = {}
        self.total = 0

    def acquire(self, tenant: str) -> None:
        n = self.held.get(tenant, 0)
        if not within_share(n, 1, self.per_tenant, self.total, self.limit):
            raise Overloaded(
                f"tenant {tenant!r} has {n} requests in flight in this worker, past its share of"
                f" max_concurrency={self.limit} while the rest is kept for other tenants; retry"
            )
        self.held[tenant] = n + 1
        self.total += 1

    def release(self, tenant: str) -> None:
        self.total -= 1
        n = self.held[tenant] - 1
        if n:
            self.held[tenant] = n
        else:
            del self.held[tenant]


SLOTS = web.AppKey("tenant_slots", TenantSlots)
