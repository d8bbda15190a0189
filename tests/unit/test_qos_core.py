"""The QoS core without a server: the node-wide token buckets (a forked
process and this one stand for two workers) and the weighted fair gate."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections import Counter

import pytest

from kvstore.errors import InvalidInput
from kvstore.qos.buckets import BURST_S, RateTable, shared_table
from kvstore.qos.fair import REQUEST_COST, FairGate
from kvstore.qos.policy import Qos, apply_changes, parse_qos, stored_overrides


def test_policy_parsing_and_defaults() -> None:
    assert parse_qos({"weight": 5, "read_bytes_per_s": None}) == {"weight": 5, "read_bytes_per_s": None}
    assert parse_qos(None) == dict.fromkeys(("weight", "read_bytes_per_s", "write_bytes_per_s", "requests_per_s"))
    for bad in ({"weight": 0}, {"weight": 1001}, {"requests_per_s": -1}, {"x": 1}, [], {"weight": False}):
        with pytest.raises(InvalidInput):
            parse_qos(bad)
    own = apply_changes({"weight": 5}, {"weight": None, "requests_per_s": 3})
    assert own == {"requests_per_s": 3}
    assert Qos(weight=7, read_bytes_per_s=9).with_(own) == Qos(7, 9, 0, 3)
    assert stored_overrides({"weight": 3, "junk": 1, "read_bytes_per_s": "x"}) == {"weight": 3}
    assert stored_overrides(None) == {}


class Clock:
    """A clock that moves only when a test moves it: the buckets' arithmetic
    checked exactly, whatever the machine's speed (RateTable's ``clock``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_a_bucket_passes_its_burst_then_makes_reservations_wait() -> None:
    table = RateTable(None, clock=Clock())
    rate = 1000.0
    assert table.take("t", "read", rate * BURST_S, rate, 0.0) == 0.0  # the burst
    assert table.take("t", "read", 100, rate, 10.0) == pytest.approx(0.1)  # in debt: told to wait for it
    assert table.take("t", "read", 100, rate, 10.0) == pytest.approx(0.2)  # queued behind the first
    assert table.take("t", "read", 100, rate, 0.25) == pytest.approx(-0.3)  # would wait too long: nothing taken
    assert table.take("t", "read", 100, rate, 10.0) == pytest.approx(0.3)  # (so this one waits as long)
    assert table.take("t", "write", 100, rate, 0.0) == 0.0  # another kind, another bucket
    assert table.take("u", "read", 100, rate, 0.0) == 0.0  # another tenant
    table.close()


def test_a_block_larger_than_the_bucket_passes_when_it_is_full() -> None:
    clock = Clock()
    table = RateTable(None, clock=clock)
    assert table.take("t", "write", 10_000, 1000.0, 0.0) == 0.0  # ten seconds of the rate, at once
    assert table.take("t", "write", 1, 1000.0, 1.0) == pytest.approx(-9.501)  # then the debt, and the one
    clock.advance(9.5)
    assert table.take("t", "write", 1, 1000.0, 1.0) == pytest.approx(0.001)  # the debt paid at the rate
    table.close()


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    table = RateTable(None, clock=clock)
    rate = 1000.0
    assert table.take("t", "read", rate * BURST_S, rate, 0.0) == 0.0
    clock.advance(0.25)
    assert table.take("t", "read", 250, rate, 0.0) == 0.0  # a quarter second of the rate came back
    assert table.take("t", "read", 1, rate, 0.0) < 0  # and no more
    clock.advance(3600)  # an idle hour refills the burst, not an hour of the rate
    assert table.take("t", "read", rate * BURST_S, rate, 0.0) == 0.0
    assert table.take("t", "read", 1, rate, 0.0) < 0
    table.close()


def test_what_is_given_back_refills_up_to_the_burst() -> None:
    table = RateTable(None, clock=Clock())
    rate = 1000.0
    assert table.take("t", "read", 100, rate, 0.0) == 0.0
    table.give_back("t", "read", 10_000, rate)  # more than was taken: the bucket is full, no fuller
    assert table.take("t", "read", rate * BURST_S, rate, 0.0) == 0.0
    assert table.take("t", "read", 1, rate, 0.0) < 0
    table.close()


def test_a_stamp_from_another_boot_reads_as_a_full_bucket() -> None:
    clock = Clock(now=50_000.0)
    table = RateTable(None, clock=clock)
    assert table.take("t", "read", 500, 1000.0, 0.0) == 0.0
    assert table.take("t", "read", 500, 1000.0, 0.0) < 0  # spent
    clock.now = 3.0  # CLOCK_MONOTONIC of a boot since: the stamp is in its future
    assert table.take("t", "read", 500, 1000.0, 0.0) == 0.0
    table.close()


def _spend_the_burst(fd: int, rate: float) -> None:
    table = RateTable(fd)
    assert table.take("t", "read", rate * BURST_S, rate, 0.0) == 0.0
    table.add_served({"t": (5, 6, 7)})
    table.close()


def test_two_workers_share_one_tenant_bucket() -> None:
    """A forked worker spends the tenant's burst in the shared table; the
    other worker sees it spent, and both workers' served counts add up."""
    fd = shared_table()
    rate = 1000.0
    child = multiprocessing.get_context("fork").Process(target=_spend_the_burst, args=(fd, rate))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    b = RateTable(fd)
    assert b.take("t", "read", 100, rate, 0.0) < 0  # the other worker sees it spent
    b.give_back("t", "read", 100, rate)
    b.add_served({"t": (1, 1, 1)})
    assert b.served(["t"]) == {"t": (6, 7, 8)}
    b.close()
    os.close(fd)


def test_the_shared_table_is_memory_not_a_file() -> None:
    """No file of the data directory backs it (a full disk made a write to a
    mapped file's page SIGBUS, killing the writer), and an fd that is not a
    table is refused."""
    fd = shared_table()
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvstore-qos-rates")
        assert not os.get_inheritable(fd)  # close-on-exec: forked workers hold it, exec'd programs do not
    finally:
        os.close(fd)
    r, w = os.pipe()
    with pytest.raises((ValueError, OSError)):
        RateTable(r)
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("tick", [0.0001, 0.001, 0.013, 0.2])
def test_over_a_window_a_tenant_gets_its_rate_plus_the_burst(tick: float) -> None:
    """Reservations as fast as they are allowed, at every ``tick`` of the
    clock for two seconds: over the ``elapsed`` seconds from the first to
    the last, what passed is rate * (elapsed + BURST_S) within one request,
    however often the tenant asks."""
    clock = Clock()
    table = RateTable(None, clock=clock)
    rate, n, passed = 200_000.0, 10_000, 0
    start = clock.now
    for _ in range(round(2.0 / tick) + 1):
        while table.take("t", "read", n, rate, 0.0) == 0.0:
            passed += n
        elapsed = clock.now - start
        clock.advance(tick)
    assert rate * (elapsed + BURST_S) - n <= passed <= rate * (elapsed + BURST_S) + n


async def test_the_fair_gate_shares_slots_by_weight() -> None:
    gate = FairGate(slots=1)
    assert gate.try_enter("x", 100)  # the one slot, held while the others queue
    served: Counter[str] = Counter()
    block = 1 << 20

    async def transfer(tenant: str, weight: int) -> None:
        assert await gate.enter(tenant, weight, timeout_s=30)
        served[tenant] += 1
        gate.charge(tenant, weight, block)
        await asyncio.sleep(0)
        gate.leave(tenant)

    tasks = [asyncio.create_task(transfer("a", 300)) for _ in range(60)]
    tasks += [asyncio.create_task(transfer("b", 100)) for _ in range(60)]
    await asyncio.sleep(0)
    assert not gate.try_enter("c", 100)  # nobody jumps the queue on the fast path
    gate.leave("x")
    while served["a"] < 60:
        await asyncio.sleep(0)
    # While both were waiting, a got three turns for each of b's.
    assert 15 <= served["b"] <= 25, served
    await asyncio.gather(*tasks)


async def test_a_light_tenant_goes_before_a_backlog() -> None:
    gate = FairGate(slots=1)
    assert gate.try_enter("flood", 100)
    order: list[str] = []

    async def transfer(tenant: str) -> None:
        assert await gate.enter(tenant, 100, timeout_s=30)
        order.append(tenant)
        gate.charge(tenant, 100, 1 << 20)
        await asyncio.sleep(0)
        gate.leave(tenant)

    gate.charge("flood", 100, 64 << 20)  # what the flood has been served
    flood = [asyncio.create_task(transfer("flood")) for _ in range(16)]
    await asyncio.sleep(0)
    light = asyncio.create_task(transfer("light"))
    await asyncio.sleep(0)
    gate.leave("flood")
    await asyncio.gather(*flood, light)
    assert order.index("light") == 0


async def test_a_wait_for_a_slot_times_out_and_a_cancelled_grant_passes_on() -> None:
    gate = FairGate(slots=1)
    assert gate.try_enter("a", 100)
    assert not await gate.enter("b", 100, timeout_s=0.01)
    assert gate.waiting("b") == 0
    waiter = asyncio.create_task(gate.enter("b", 100, timeout_s=30))
    other = asyncio.create_task(gate.enter("c", 100, timeout_s=30))
    await asyncio.sleep(0)
    gate.leave("a")  # granted to b (or c) ...
    waiter.cancel()  # ... and b goes away: the slot passes to c
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await other
    assert gate.busy == 1
    assert REQUEST_COST > 0


async def test_no_tenant_takes_every_slot() -> None:
    """A tenant alone takes up to its share and the headroom (6 of 8); the
    last quarter is another tenant's at once, however many the first queued."""
    gate = FairGate(slots=8)
    taken = sum(gate.try_enter("flood", 100) for _ in range(10))
    assert taken == 6
    queued = [asyncio.create_task(gate.enter("flood", 100, timeout_s=30)) for _ in range(4)]
    await asyncio.sleep(0)
    assert gate.try_enter("light", 100)  # no wait, no turn to take
    assert await gate.enter("light", 100, timeout_s=0.01)  # nor through the queue
    assert not gate.try_enter("third", 100)  # every slot in use now
    gate.leave("light")
    gate.leave("light")
    gate.leave("flood")  # the flood's own queue moves as its slots come back, within its share
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in queued) == 1
    for t in queued:
        t.cancel()
    await asyncio.gather(*queued, return_exceptions=True)


def test_the_client_planners_burst_is_the_buckets() -> None:
    """The engine adapters' load planner counts on the bucket's burst (a
    load under a read limit gets BURST_S of the rate at once)."""
    from kvstore_client.adapters import planner

    assert planner.QOS_BURST_S == BURST_S
