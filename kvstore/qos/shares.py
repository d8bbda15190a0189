"""What one tenant may hold of something every tenant shares in a worker
(its request-body memory, its requests in flight, its transfer slots): its
share, or more only while some stays free for the others. One tenant alone
may use most of it; however it uses it, a tenant that arrives finds room.

A worker bounds the request bodies it holds in memory
(``max_buffered_body_bytes``, :class:`BodyBudget`) and its requests in flight
(``max_concurrency``, :class:`TenantSlots`). Bounded only in total, one
tenant could hold all of either: PUTs that declare large bodies and send a
few bytes kept every other tenant's PUTs at ``503 overloaded`` until
``request_timeout_s``, and enough of them held every slot, so other tenants'
GETs failed too. Each tenant may hold its QoS weight's part of each among
the tenants holding some (:data:`TENANT_SHARE` while it is alone, or between
equal weights; of the body budget, one block's body at least), and more only
while :data:`HEADROOM` of it stays free for the other tenants. Past that a
tenant's own requests get ``503 overloaded`` at once, saying so. Counted per
worker, on the event loop (no lock), through the worker's admission
(admission.py) on every transport.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import Overloaded
from kvstore.qos.policy import DEFAULT_WEIGHT

TENANT_SHARE = 0.5  # of a worker's body budget, requests in flight and transfer slots, per tenant
HEADROOM = 0.25  # of each, kept for the other tenants once a tenant is past its share


def within_share(held: int, n: int, share: int, total: int, limit: int) -> bool:
    """Whether a tenant that holds ``held`` of ``total`` in use may take ``n``
    more: within its ``share``, or past it while HEADROOM of ``limit`` stays free."""
    return held + n <= share or total + n <= limit - int(limit * HEADROOM)


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
        held = self.held
        if not held or (len(held) == 1 and tenant in held):
            return self.per_tenant  # alone: TENANT_SHARE of it (no weights to ask)
        w = self.weight_of(tenant)
        total = w + sum(self.weight_of(t) for t in held if t != tenant)
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

    def try_acquire(self, tenant: str) -> bool:
        """One more for ``tenant`` if its share allows (else False, nothing taken)."""
        if not self.take(tenant, 1, self.total):
            return False
        self.total += 1
        return True

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


class BodyBudget(Shares):
    """Bytes of request bodies held in memory by this process, against a
    limit, and by each tenant, against its share of it (shares.py: half, or
    one block's body at least, ``floor``; more while a quarter stays free for
    the others). Used from the event loop only (no lock)."""

    def __init__(self, limit: int, floor: int = 0) -> None:
        super().__init__(limit, floor)
        self.used = 0

    def reserve(self, n: int, tenant: str | None = None) -> None:
        """Count ``n`` more bytes (``tenant``'s, when a tenant's request holds
        them), or raise Overloaded if they do not fit."""
        if self.used + n > self.limit:
            raise Overloaded(
                f"request bodies buffered in memory are at the limit (max_buffered_body_bytes={self.limit}); retry"
            )
        if tenant is not None and not self.take(tenant, n, self.used):
            raise Overloaded(
                f"tenant {tenant!r} holds {self.held.get(tenant, 0)} bytes of request bodies in this worker; {n} more"
                f" would pass its share of max_buffered_body_bytes={self.limit} ({self.share(tenant)}) while the rest"
                " is kept for other tenants; retry"
            )
        self.used += n

    def release(self, n: int, tenant: str | None = None) -> None:
        self.used -= n
        if tenant is not None:
            self.give(tenant, n)
