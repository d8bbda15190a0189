"""A worker's admission (kvstore/qos/admission.py), the one object every
transport asks: what a ticket takes, what a refused one leaves (nothing),
and that closing gives everything back once. A real token table on a
hand-driven clock; the daemons' tests (tests/http/test_qos.py,
test_tenant_shares.py) check the same decisions through the lane and the
routes."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.errors import Overloaded, RateLimited
from kvstore.metrics import Metrics
from kvstore.qos.admission import Admission
from kvstore.qos.buckets import RateTable
from kvstore.qos.policy import Qos


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admission(policies: dict[str, Qos] | None = None, limit: int = 8, transfers: int = 2) -> tuple[Admission, Clock]:
    clock = Clock()
    adm = Admission(Metrics(), limit, 1 << 20, 1 << 16)
    adm.start(lambda t: (policies or {}).get(t, Qos()), RateTable(None, clock), transfers, 0.0, 1.0)
    adm.ready = True
    return adm, clock


def _counter(adm: Admission, name: str, **labels: str) -> float:
    snap = adm.metrics.snapshot()["counters"]
    want = sorted(labels.items())
    return sum(v for n, ls, v in snap if n == name and sorted(map(tuple, ls)) == want)


def test_try_enter_takes_nothing_when_it_refuses() -> None:
    adm, _ = _admission({"a": Qos(requests_per_s=2)}, limit=4)
    adm.ready = False
    assert adm.try_enter("a") is None  # the store is not open
    adm.ready = True
    tickets = [adm.try_enter("a") for _ in range(2)]  # a bucket holds one request (burst of 2/s): then refused
    assert tickets[0] is not None and tickets[1] is None
    assert (adm.inflight, adm.slots.total) == (1, 1)  # the refused one holds nothing
    tickets[0].refuse()  # handed to the route after all: its request back too
    assert (adm.inflight, adm.slots.total, adm.slots.held) == (0, 0, {})
    assert adm.try_enter("a") is not None  # the token given back is there again


def test_requests_in_flight_and_a_tenants_share() -> None:
    adm, _ = _admission(limit=4)
    a = [adm.try_enter("a") for _ in range(3)]  # past its half while a quarter stays free
    assert all(t is not None for t in a)
    assert adm.try_enter("a") is None  # would leave less than a quarter for the others
    b = adm.try_enter("b")
    assert b is not None and adm.inflight == 4
    assert adm.try_enter("c") is None  # max_concurrency
    with pytest.raises(Overloaded):
        adm.begin()
    for t in [*a, b]:
        assert t is not None
        t.answered()
        t.close()
        t.close()  # once only
    assert (adm.inflight, adm.slots.total, adm.slots.held) == (0, 0, {})
    assert _counter(adm, "kvstore_tenant_requests_total", tenant="a") == 3


async def test_enter_waits_for_a_transfer_slot_and_close_gives_it_back() -> None:
    adm, _ = _admission(transfers=1)
    first = await adm.enter("a", bulk=True)
    waiting = asyncio.ensure_future(adm.enter("b", bulk=True))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the only slot is a's
    first.close()
    second = await asyncio.wait_for(waiting, 1)
    assert second.try_transfer()  # it holds one already
    second.close()
    assert adm.slots.held == {}
    assert adm.qos is not None and adm.qos.gate.busy == 0
    third = await adm.enter("a", bulk=True)  # the slot is free again
    assert adm.qos.gate.held == {"a": 1}
    third.close()
    assert adm.qos.gate.held == {}


async def test_limits_and_counts_go_through_the_ticket() -> None:
    adm, clock = _admission({"a": Qos(read_bytes_per_s=1000)})
    t = await adm.enter("a")
    assert t.try_reserve("read", 500)  # the bucket holds half a second of the rate
    assert not t.try_reserve("read", 1)
    with pytest.raises(RateLimited):  # qos_max_wait_ms 0: no wait, a 429
        await t.reserve("read", 100)
    clock.now += 0.1
    assert t.try_reserve("read", 100)
    t.charge("read", 10_000)  # moved by the client after the answer: in debt
    clock.now += 1.0
    assert not t.try_reserve("read", 1)  # still paying it back
    t.moved("out", 4096)
    t.close()
    assert _counter(adm, "kvstore_http_bytes_out_total") == 4096
    assert _counter(adm, "kvstore_tenant_bytes_total", tenant="a", direction="out") == 4096


async def test_relayed_and_untenanted_requests_are_not_limited() -> None:
    adm, _ = _admission({"a": Qos(requests_per_s=1, write_bytes_per_s=1)})
    relayed = await adm.enter("a", limited=False)  # the writer limits it
    assert relayed.try_reserve("write", 10**9)
    relayed.close()
    anon = adm.untenanted()
    anon.hold_body(1000)
    assert adm.budget.used == 1000 and adm.budget.held == {}  # the total only
    anon.release_body(1000)
    anon.moved("in", 7)
    assert _counter(adm, "kvstore_http_bytes_in_total") == 7
    assert adm.slots.total == 0
