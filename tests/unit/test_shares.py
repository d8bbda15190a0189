"""Tenants' shares of a worker's body budget and requests in flight
(kvstore/qos/shares.py): a tenant alone may use most of them, a
tenant past its share leaves a quarter to the others, and what is given back
is counted back exactly."""

from __future__ import annotations

import pytest

from kvstore.errors import Overloaded
from kvstore.qos.shares import BodyBudget, TenantSlots, within_share


def test_within_share() -> None:
    assert (
        within_share(0, 50, 50, 90, 100) is True
    )  # within its share, whatever the others hold... (the total is checked apart)
    assert within_share(50, 1, 50, 50, 100) is True  # past it while 25 of 100 stay free
    assert within_share(74, 1, 50, 74, 100) is True
    assert within_share(75, 1, 50, 75, 100) is False  # would leave less than a quarter


def test_slots_let_one_tenant_use_most_and_keep_a_quarter_for_others() -> None:
    slots = TenantSlots(100)
    for _ in range(75):
        slots.acquire("a")
    with pytest.raises(Overloaded, match=r"'a' has 75 requests in flight.*share of max_concurrency=100"):
        slots.acquire("a")
    for _ in range(25):  # another tenant's share is still there
        slots.acquire("b")
    slots.release("a")
    with pytest.raises(Overloaded):
        slots.acquire("a")  # past its share and the others are busy: a quarter is theirs
    for _ in range(25):
        slots.release("b")
    slots.acquire("a")
    for _ in range(75):
        slots.release("a")
    assert slots.held == {} and slots.total == 0


def test_body_budget_shares_and_floor() -> None:
    mib = 1 << 20
    budget = BodyBudget(256 * mib, floor=64 * mib)
    assert budget.per_tenant == 128 * mib
    for _ in range(3):
        budget.reserve(64 * mib, "attacker")  # 192 MiB: past its share while 64 stay free
    with pytest.raises(Overloaded, match=r"'attacker' holds 201326592 bytes.*share of max_buffered_body_bytes"):
        budget.reserve(4096, "attacker")
    budget.reserve(2 * mib, "victim")
    budget.reserve(mib)  # an admin call's JSON body: the total only
    with pytest.raises(Overloaded, match="at the limit"):
        budget.reserve(64 * mib, "victim")
    budget.release(mib)
    budget.release(2 * mib, "victim")
    budget.release(0, "victim")  # nothing read yet: nothing held
    for _ in range(3):
        budget.release(64 * mib, "attacker")
    assert budget.used == 0 and budget.held == {}
    small = BodyBudget(5 * mib, floor=4 * mib)  # a budget of about one block: a tenant may still hold one
    small.reserve(4 * mib, "t")
    with pytest.raises(Overloaded):
        small.reserve(1000, "t")
    small.reserve(1000, "u")


def test_shares_follow_weights() -> None:
    """Between tenants holding some, each one's share is its weight's part:
    300:100 of 100 slots is 75:25; alone, TENANT_SHARE (half) whatever its weight."""
    slots = TenantSlots(100)
    weights = {"heavy": 300, "light": 100}
    slots.weight_of = weights.__getitem__
    assert slots.share("heavy") == 50 and slots.share("light") == 50  # each alone
    slots.acquire("light")
    slots.acquire("heavy")
    assert slots.share("heavy") == 75 and slots.share("light") == 25
    for _ in range(73):
        slots.acquire("heavy")
    for _ in range(24):
        slots.acquire("light")
    with pytest.raises(Overloaded):
        slots.acquire("light")  # past its 25 with less than a quarter free
    slots.acquire("heavy")
    assert slots.held == {"heavy": 75, "light": 25}
