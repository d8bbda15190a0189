"""Counting what the HTTP API moves, per worker and per tenant.

``kvstore_http_bytes_in_total`` / ``_out_total`` count block bytes received
and sent; ``kvstore_tenant_bytes_total{tenant,direction}`` the same bytes by
tenant, and ``kvstore_tenant_requests_total{tenant}`` each tenant's requests
(counted by every worker that answers or relays one, like
``kvstore_http_requests_total``). The routes and the fast lane count through
these, so that the two never differ.
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web

from kvstore.metrics import Metrics
from kvstore.transport.http.appkeys import METRICS
from kvstore.transport.http.qos import QOS

Direction = Literal["in", "out"]


def count_bytes(app: web.Application, direction: Direction, n: int, tenant: str | None) -> None:
    """``n`` bytes of blocks in or out: the worker's total, and its tenant's
    (also what the tenant is served, for QoS: kvstore/transport/http/qos.py)."""
    metrics = app[METRICS]
    if tenant is not None and QOS in app:
        app[QOS].served(tenant, "read" if direction == "out" else "write", n)
    if direction == "in":  # (each name written out: tests/unit/test_observability.py looks for them)
        metrics.inc("kvstore_http_bytes_in_total", n)
    else:
        metrics.inc("kvstore_http_bytes_out_total", n)
    if tenant is not None:
        metrics.inc("kvstore_tenant_bytes_total", n, tenant=tenant, direction=direction)


def count_request(metrics: Metrics, tenant: str) -> None:
    """One request of ``tenant``'s (its QoS count is taken with its token: qos.py)."""
    metrics.inc("kvstore_tenant_requests_total", tenant=tenant)
