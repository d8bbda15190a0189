"""What one tenant may hold of something every tenant shares in a worker
(its request-body memory, its requests in flight, its transfer slots): its
share, or more only while some stays free for the others. One tenant alone
may use most of it; however it uses it, a tenant that arrives finds room."""

from __future__ import annotations

TENANT_SHARE = 0.5  # of a worker's body budget, requests in flight and transfer slots, per tenant
HEADROOM = 0.25  # of each, kept for the other tenants once a tenant is past its share


def within_share(held: int, n: int, share: int, total: int, limit: int) -> bool:
    """Whether a tenant that holds ``held`` of ``total`` in use may take ``n``
    more: within its ``share``, or past it while HEADROOM of ``limit`` stays free."""
    return held + n <= share or total + n <= limit - int(limit * HEADROOM)
