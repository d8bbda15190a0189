"""A worker's admission: every decision on whether, when and how much a
request may take, made here once for every transport.

One :class:`Admission` per worker owns

- readiness (the store is open) and the requests in flight, against
  ``max_concurrency``;
- each tenant's shares of the requests in flight and of the request bodies
  held in memory (shares.py);
- the tenants' QoS: the node's token buckets, the worker's fair gate and what
  each tenant was served (limits.py);
- the counts of requests and bytes every transport reports on ``/metrics``.

A transport asks for a :class:`Ticket` when it has a request's tenant:
:meth:`Admission.enter` waits (a route, the S3 gateway), and
:meth:`Admission.try_enter` never does (the HTTP fast lane, which hands a
request it cannot finish at once to the route, having taken nothing). The
request's bytes go through the ticket (reserve, charge, moved, a transfer
slot, a body held), and :meth:`Ticket.close` gives back what it holds, once.
No transport touches the parts; a new policy is written here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

from kvstore.errors import Overloaded
from kvstore.metrics import Metrics
from kvstore.qos.buckets import Kind, RateTable
from kvstore.qos.limits import QosSource, TenantQos
from kvstore.qos.policy import Qos
from kvstore.qos.shares import BodyBudget, TenantSlots

Direction = Literal["in", "out"]


class Admission:
    """One worker's admission (module doc). ``max_concurrency`` bounds the
    requests in flight, ``body_limit`` the request bodies held in memory (a
    tenant's share of it is one block's body, ``block_size``, at least)."""

    def __init__(self, metrics: Metrics, max_concurrency: int, body_limit: int, block_size: int) -> None:
        self.metrics = metrics
        self.ready = False  # the store is open; false again once shutdown begins
        self.limit = max_concurrency
        self.inflight = 0
        self.slots = TenantSlots(max_concurrency)
        self.budget = BodyBudget(body_limit, block_size)
        self.qos: TenantQos | None = None  # the tenants' QoS, once the store is open (start)

    def start(self, policy: QosSource, table: RateTable, transfers: int, max_wait_s: float, slot_wait_s: float) -> None:
        """The tenants' QoS on: ``policy`` gives a tenant's limits and weight
        now, ``table`` holds the node's buckets, ``transfers`` slots of the
        fair gate wait at most ``slot_wait_s``, a limit at most ``max_wait_s``."""
        qos = TenantQos(policy, table, transfers, max_wait_s, self.metrics)
        qos.slot_timeout_s = slot_wait_s
        self.qos = qos
        # Each tenant's share of the body budget and of the requests in flight follows its weight.
        self.budget.weight_of = self.slots.weight_of = qos.weight

    # -- the process's requests in flight ------------------------------------

    def begin(self) -> None:
        """One more request in flight, or ``Overloaded`` (503) at ``max_concurrency``."""
        if self.inflight >= self.limit:
            raise Overloaded(f"over {self.limit} requests in flight; retry")
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1

    # -- a tenant's request ----------------------------------------------------

    async def enter(self, tenant: str, *, limited: bool = True, bulk: bool = False, counted: bool = True) -> Ticket:
        """``tenant``'s request admitted, waiting as its limits say: counted
        (``counted``; a request a reader worker relays to the writer is
        counted by the reader, where the client sent it), within its share of
        the requests in flight (else ``Overloaded``), one of its
        ``requests_per_s`` (``limited``; a request relayed to the writer is
        limited there), and for a ``bulk`` read a slot of the fair gate for
        the whole request. Over a limit for longer than ``qos_max_wait_ms``:
        ``RateLimited``, nothing held. (The caller holds the request in
        flight: :meth:`begin`.)"""
        if counted:
            self.metrics.inc("kvstore_tenant_requests_total", tenant=tenant)
        self.slots.acquire(tenant)
        ticket = Ticket(self, tenant, limited)
        try:
            if limited and self.qos is not None:
                await ticket.reserve("request", 1)
                ticket.served("request", 1)
                if bulk:
                    await ticket._enter_gate()
        except BaseException:
            ticket.close()
            raise
        return ticket

    def try_enter(self, tenant: str, *, counted: bool = True) -> Ticket | None:
        """``tenant``'s request admitted if nothing needs a wait: the store
        open, a request in flight free and within the tenant's share, one of
        its ``requests_per_s`` at hand. None: nothing taken (the caller hands
        the request to a path that may wait; so does :meth:`Ticket.refuse`,
        later). Counted by :meth:`Ticket.answered`, once it is answered
        (``counted``: as :meth:`enter`)."""
        if not self.ready or self.inflight >= self.limit:
            return None
        if not self.slots.try_acquire(tenant):
            return None
        self.inflight += 1
        ticket = Ticket(self, tenant, True, in_flight=True)
        ticket.counted = counted
        if not ticket.try_reserve("request", 1):
            ticket.close()
            return None
        return ticket

    def untenanted(self) -> Ticket:
        """A ticket for a request of no tenant's (the admin's, a probe): it
        counts the node's bytes and holds bodies against the total only."""
        return Ticket(self, None, False)

    def flush(self, tenants: list[str] | None) -> None:
        """What this worker served, added to the node's counts (limits.py)."""
        if self.qos is not None:
            self.qos.flush(tenants)

    def rates(self, tenant: str) -> dict[str, float]:
        """The tenant's node-wide rates over the last few seconds (the writer's view)."""
        return self.qos.rates(tenant) if self.qos is not None else {}

    def close(self) -> None:
        if self.qos is not None:
            self.qos.table.close()


class Ticket:
    """What one request holds of its worker, and every count of what it moves.
    Given back once by :meth:`close` (a fast-lane GET's transfer slot stays
    held until its bytes are sent: :meth:`hold_until_sent`)."""

    __slots__ = ("_adm", "_gate", "_in_flight", "_policy", "_slot", "counted", "limited", "tenant")

    def __init__(self, adm: Admission, tenant: str | None, limited: bool, in_flight: bool = False) -> None:
        self._adm = adm
        self.tenant = tenant
        self.limited = limited and tenant is not None  # its QoS applies (not relayed, not the admin's)
        self._in_flight = in_flight  # it holds one of the process's requests in flight
        self._slot = tenant is not None  # it holds one of the tenant's requests in flight
        self._gate = False  # it holds a slot of the fair gate
        self._policy: Qos | None = None  # the tenant's QoS, taken once per request (_limits)
        self.counted = True  # answered() counts it in the tenant's requests (not a relayed one: try_enter)

    def _qos(self) -> TenantQos | None:
        return self._adm.qos if self.limited else None

    def _limits(self, qos: TenantQos, tenant: str) -> Qos:
        """The tenant's QoS for this request: asked once (a change applies
        from the tenant's next request)."""
        policy = self._policy
        if policy is None:
            policy = self._policy = qos.policy(tenant)
        return policy

    # -- the tenant's limits ---------------------------------------------------

    async def reserve(self, kind: Kind, n: int) -> None:
        """``n`` of the tenant's ``kind`` before they move, waiting up to
        ``qos_max_wait_ms`` (past that ``RateLimited``, nothing taken)."""
        qos, tenant = self._qos(), self.tenant
        if qos is not None and tenant is not None:
            await qos.take(tenant, kind, n, self._limits(qos, tenant))

    def try_reserve(self, kind: Kind, n: int) -> bool:
        """``n`` of ``kind`` if that needs no wait (else False, nothing taken)."""
        qos, tenant = self._qos(), self.tenant
        return qos is None or tenant is None or qos.try_take(tenant, kind, n, self._limits(qos, tenant))

    def give_back(self, kind: Kind, n: int) -> None:
        """``n`` of ``kind`` reserved and not used."""
        qos, tenant = self._qos(), self.tenant
        if qos is not None and tenant is not None:
            qos.give_back(tenant, kind, n, self._limits(qos, tenant))

    def charge(self, kind: Kind, n: int) -> None:
        """``n`` of ``kind`` the client moves itself after the answer (a read
        plan's, a NIXL read's): taken now, in debt if need be, and served."""
        qos, tenant = self._qos(), self.tenant
        if qos is not None and tenant is not None:
            qos.charge(tenant, kind, n, self._limits(qos, tenant))
        self.served(kind, n)

    def served(self, kind: Kind, n: int) -> None:
        """``n`` of ``kind`` served to the tenant (its fair-gate service and the node's counts)."""
        qos, tenant = self._adm.qos, self.tenant
        if qos is not None and tenant is not None:
            qos.served(tenant, kind, n, self._limits(qos, tenant) if kind != "request" else None)

    def moved(self, direction: Direction, n: int) -> None:
        """``n`` bytes of blocks received (``in``) or sent (``out``): the
        worker's totals, the tenant's bytes, and what it was served."""
        metrics = self._adm.metrics
        if direction == "in":  # (each name written out: tests/unit/test_observability.py looks for them)
            metrics.inc("kvstore_http_bytes_in_total", n)
        else:
            metrics.inc("kvstore_http_bytes_out_total", n)
        if self.tenant is not None:
            metrics.inc("kvstore_tenant_bytes_total", n, tenant=self.tenant, direction=direction)
            self.served("read" if direction == "out" else "write", n)

    def answered(self) -> None:
        """A request admitted by :meth:`Admission.try_enter` is answered: counted."""
        if self.tenant is not None:
            if self.counted:
                self._adm.metrics.inc("kvstore_tenant_requests_total", tenant=self.tenant)
            self.served("request", 1)

    def refuse(self) -> None:
        """A request admitted by :meth:`Admission.try_enter` goes to a path
        that may wait after all: everything it took is given back, its
        request of ``requests_per_s`` too (that path takes its own)."""
        self.give_back("request", 1)
        self.close()

    # -- the fair gate ---------------------------------------------------------

    async def _enter_gate(self) -> None:
        qos, tenant = self._qos(), self.tenant
        if qos is not None and tenant is not None and not self._gate:
            await qos.enter(tenant, self._limits(qos, tenant))
            self._gate = True

    def _leave_gate(self) -> None:
        qos = self._adm.qos
        if self._gate and qos is not None and self.tenant is not None:
            self._gate = False
            qos.gate.leave(self.tenant)

    @contextlib.asynccontextmanager
    async def transfer(self) -> AsyncIterator[None]:
        """A slot of the worker's fair gate for the ``async with`` block,
        waited for by weight (none needed: none taken): a bulk read's whole
        request, a write's store once its body is in (never while a body
        arrives: a client decides how long that takes)."""
        if self._gate:
            yield
            return
        await self._enter_gate()
        try:
            yield
        finally:
            self._leave_gate()

    def try_transfer(self) -> bool:
        """A slot of the fair gate if one is free for the tenant now."""
        qos, tenant = self._qos(), self.tenant
        if qos is None or tenant is None or self._gate:
            return True
        if not qos.gate.try_enter(tenant, self._limits(qos, tenant).weight):
            return False
        self._gate = True
        return True

    def hold_until_sent(self, transport: asyncio.WriteTransport) -> None:
        """The answer's bytes the socket did not take at once are still the
        transfer's, in ``transport``'s buffer: its gate slot is given back
        once that buffer is empty (or the connection gone), so slots count
        transfers in progress on every path."""
        qos = self._adm.qos
        if self._gate and qos is not None and self.tenant is not None:
            self._gate = False
            qos.hold_until_sent(self.tenant, transport)

    # -- request bodies held in memory -----------------------------------------

    def hold_body(self, n: int) -> None:
        """``n`` more bytes of request body held in memory, within the
        worker's budget and the tenant's share of it (else ``Overloaded``).
        Whoever holds them gives them back (:meth:`release_body`), also after
        the ticket is closed: a batch's blocks are held until they are stored."""
        self._adm.budget.reserve(n, self.tenant)

    def release_body(self, n: int) -> None:
        self._adm.budget.release(n, self.tenant)

    # -- the end ---------------------------------------------------------------

    def close(self) -> None:
        """What the request still holds, given back: its transfer slot, its
        share of the requests in flight (request bodies are given back by
        whoever holds them: :meth:`release_body`)."""
        adm = self._adm
        self._leave_gate()
        if self._slot and self.tenant is not None:
            self._slot = False
            adm.slots.release(self.tenant)
        if self._in_flight:
            self._in_flight = False
            adm.end()
