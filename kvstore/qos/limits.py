"""A worker's QoS: each tenant's node-wide limits and its weight in a busy
worker, as every transport applies them through the worker's admission
(admission.py).

- Every request of a tenant takes one of its ``requests_per_s`` (in the
  gate, so lookups, HEADs and lease releases too: they wait for nothing
  else, never behind bulk bytes).
- A bulk read (a block, a record, a batch of blocks, a NIXL read) takes a slot of the worker's fair gate
  (fair.py), waiting its turn by weight while they are all taken; a block
  write takes one for its store, once its body is in.
- The bytes of a block read (known before it is sent) and of a block write
  (its Content-Length, before the body is read) are reserved from the
  tenant's ``read_bytes_per_s`` / ``write_bytes_per_s`` first. Bytes whose
  size is known only as they move (batches, records, read plans, NIXL
  transfers) are charged as they move: the tenant's next request waits for
  them.
- A reservation waits at most ``qos_max_wait_ms``; one that would wait longer
  is answered ``429 rate_limited`` with ``Retry-After`` (S3's ``SlowDown``
  on the gateway), having taken nothing.

With several workers a request relayed to the writer is limited there, once,
not on the reader that relays it. Maintenance (compaction, mirroring,
scrubs, the TTL sweeper) is not a tenant: it has its own rate
(``compact_rate``) and takes no tenant's tokens, and the tenants' bytes are
what they move through the API.

``/metrics``: ``kvstore_tenant_throttled_seconds_total{tenant}`` (time waited
on a limit or for a slot), ``kvstore_tenant_rate_limited_total{tenant}``
(429s), ``kvstore_tenant_queue_depth{tenant}`` (requests waiting now), beside
the bytes and requests admission.py counts.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvstore.errors import KVStoreError, Overloaded, RateLimited
from kvstore.metrics import Metrics
from kvstore.qos.buckets import KINDS, Kind, RateTable
from kvstore.qos.fair import FairGate
from kvstore.qos.policy import DEFAULT_WEIGHT, Qos

T = TypeVar("T")
QosSource = Callable[[str], Qos]  # a tenant's QoS as it applies now (the store's)
SENT_POLL_S = 0.001  # how often the lane's buffered answers are checked for being sent
RATE_WINDOW = 5  # the current rates: over the last this many flushes

_RATE_FIELD = {"read": "read_bytes_per_s", "write": "write_bytes_per_s", "request": "requests_per_s"}


class TenantQos:
    """One worker's QoS: the node's buckets, its own fair gate, its counts."""

    def __init__(self, store_qos: QosSource, table: RateTable, slots: int, max_wait_s: float, metrics: Metrics) -> None:
        self._policy = store_qos
        self.table = table
        self.gate = FairGate(slots)
        self.max_wait_s = max_wait_s
        self._metrics = metrics
        self._served: dict[str, list[int]] = {}  # since the last flush: bytes read, written, requests
        self._history: deque[tuple[float, dict[str, tuple[int, int, int]]]] = deque(maxlen=RATE_WINDOW + 1)
        self.queued: dict[str, int] = {}  # tenant -> its requests waiting on a limit or a slot
        self.slot_timeout_s = 60.0  # the most a transfer waits for a slot (request_timeout_s)
        self._sending: list[tuple[str, asyncio.WriteTransport]] = []  # lane GETs whose bytes are still buffered

    def policy(self, tenant: str) -> Qos:
        return self._policy(tenant)

    def weight(self, tenant: str) -> int:
        """The tenant's weight; the default for one unknown here (deleted meanwhile)."""
        try:
            return self._policy(tenant).weight
        except KVStoreError:
            return DEFAULT_WEIGHT

    # -- the limits -------------------------------------------------------------

    # (``policy``: the tenant's, as one request took it at its start; None: asked now.)

    def _rate(self, tenant: str, kind: Kind, policy: Qos | None = None) -> int:
        """The tenant's limit of ``kind`` per second (0: none)."""
        rate: int = getattr(policy or self.policy(tenant), _RATE_FIELD[kind])
        return rate

    def try_take(self, tenant: str, kind: Kind, n: int, policy: Qos | None = None) -> bool:
        """Take ``n`` of ``kind`` if that needs no wait (the fast lane, which never waits)."""
        rate = self._rate(tenant, kind, policy)
        return not rate or self.table.take(tenant, kind, n, rate, 0.0) == 0.0

    def give_back(self, tenant: str, kind: Kind, n: int, policy: Qos | None = None) -> None:
        rate = self._rate(tenant, kind, policy)
        if rate:
            self.table.give_back(tenant, kind, n, rate)

    async def take(self, tenant: str, kind: Kind, n: int, policy: Qos | None = None) -> None:
        """Take ``n`` of ``kind``, waiting for them up to ``qos_max_wait_ms``;
        past that, ``RateLimited`` (429) and nothing taken."""
        rate = self._rate(tenant, kind, policy)
        if not rate:
            return
        wait = self.table.take(tenant, kind, n, rate, self.max_wait_s)
        if wait < 0:
            self._metrics.inc("kvstore_tenant_rate_limited_total", tenant=tenant)
            raise RateLimited(
                f"tenant {tenant!r} is over its {_RATE_FIELD[kind]}={rate} (node-wide); retry in {-wait:.2f} s",
                retry_after=-wait,
            )
        if wait:
            await self._waiting(tenant, asyncio.sleep(wait))

    def charge(self, tenant: str, kind: Kind, n: int, policy: Qos | None = None) -> None:
        """``n`` of ``kind`` moved without a reservation: taken now, in debt
        if need be (the tenant's next requests wait for it)."""
        rate = self._rate(tenant, kind, policy)
        if rate:
            self.table.take(tenant, kind, n, rate, math.inf)

    # -- the fair gate --------------------------------------------------------

    async def enter(self, tenant: str, policy: Qos | None = None) -> None:
        """A slot of the fair gate, waiting by weight (at most ``request_timeout_s``: then 503)."""
        weight = (policy or self.policy(tenant)).weight
        if self.gate.try_enter(tenant, weight):
            return
        timeout = self.slot_timeout_s
        if not await self._waiting(tenant, self.gate.enter(tenant, weight, timeout)):
            raise Overloaded(f"no transfer slot of this worker came free within {timeout} s; retry")

    async def _waiting(self, tenant: str, aw: Awaitable[T]) -> T:
        depth = self.queued[tenant] = self.queued.get(tenant, 0) + 1
        self._metrics.set("kvstore_tenant_queue_depth", depth, tenant=tenant)
        t0 = time.monotonic()
        try:
            return await aw
        finally:
            self._metrics.inc("kvstore_tenant_throttled_seconds_total", time.monotonic() - t0, tenant=tenant)
            left = self.queued[tenant] - 1
            self._metrics.set("kvstore_tenant_queue_depth", left, tenant=tenant)
            if left:
                self.queued[tenant] = left
            else:
                del self.queued[tenant]

    def hold_until_sent(self, tenant: str, transport: asyncio.WriteTransport) -> None:
        """A fast-lane GET answered on the spot: the bytes the socket did not
        take at once are still the transfer's, in the transport's buffer. Its
        slot is given back once that buffer is empty (or the connection gone),
        so slots count transfers in progress, as the route's do."""
        if transport.is_closing() or not transport.get_write_buffer_size():
            self.gate.leave(tenant)
            return
        self._sending.append((tenant, transport))
        if len(self._sending) == 1:
            asyncio.get_running_loop().call_later(SENT_POLL_S, self._poll_sent)

    def _poll_sent(self) -> None:
        still = []
        for tenant, transport in self._sending:
            if transport.is_closing() or not transport.get_write_buffer_size():
                self.gate.leave(tenant)
            else:
                still.append((tenant, transport))
        self._sending = still
        if still:
            asyncio.get_running_loop().call_later(SENT_POLL_S, self._poll_sent)

    # -- what was served ------------------------------------------------------

    def served(self, tenant: str, kind: Kind, n: int, policy: Qos | None = None) -> None:
        """``n`` of ``kind`` served for ``tenant``: its fair-gate service and the node's counts."""
        counts = self._served.get(tenant)
        if counts is None:
            counts = self._served[tenant] = [0, 0, 0]
        counts[KINDS.index(kind)] += n
        if kind != "request":
            self.gate.charge(tenant, (policy or self.policy(tenant)).weight, n)

    def flush(self, tenants: list[str] | None) -> None:
        """Add what this worker served to the node's counts; with ``tenants``
        (the writer), sample the node's counts of those for :meth:`rates`."""
        served, self._served = self._served, {}
        if served:
            self.table.add_served({t: (c[0], c[1], c[2]) for t, c in served.items()})
        if tenants is not None:
            self._history.append((time.monotonic(), self.table.served(tenants)))

    def rates(self, tenant: str) -> dict[str, float]:
        """The tenant's node-wide rates over the last few seconds (the writer's view)."""
        zero = {"read_bytes_per_s": 0.0, "write_bytes_per_s": 0.0, "requests_per_s": 0.0}
        if len(self._history) < 2:
            return zero
        (t0, old), (t1, new) = self._history[0], self._history[-1]
        if tenant not in old or tenant not in new or t1 <= t0:
            return zero
        return {
            name: round(((b - a) & 0xFFFF_FFFF_FFFF_FFFF) / (t1 - t0), 1)
            for name, a, b in zip(zero, old[tenant], new[tenant], strict=True)
        }
