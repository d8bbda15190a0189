"""Admission's offer counts (kvstore/engine/admission.py) on a fake clock,
and the tenant registry's admission settings: kept, and defaulted in a
registry written before they existed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvstore.engine.admission import DEFAULT_ADMIT_WINDOW_S, Admission, Offers
from kvstore.engine.crypto import MasterKey
from kvstore.engine.registry import Registry
from kvstore.errors import NotAdmitted
from kvstore.metrics import Metrics
from kvstore.transport.statuses import http_status, item_answer


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_offers_count_within_the_window_from_the_first() -> None:
    clock = Clock()
    o = Offers(100, clock)
    assert [o.offer("a", "k", 10) for _ in range(3)] == [1, 2, 3]
    assert o.offer("b", "k", 10) == 1  # another tenant's key: counted apart
    clock.t += 9.5
    assert o.offer("a", "k", 10) == 4  # still within 10 s of the first offer
    clock.t += 0.5
    assert o.offer("a", "k", 10) == 1  # 10 s after the first: the count starts again
    assert o.offer("a", "k", 10) == 2
    assert o.tracked("a") == 1


def test_expired_offers_leave_the_table_in_order_of_first_offer() -> None:
    clock = Clock()
    o = Offers(100, clock)
    for i in range(5):
        o.offer("a", f"k{i}", 60)
        clock.t += 10
    assert o.tracked("a") == 5
    clock.t += 15  # k0 (65 s ago) and k1 (55 s)... only k0 is past 60 s
    o.offer("a", "new", 60)
    assert o.tracked("a") == 5  # k0 gone, "new" in
    assert o.offer("a", "k1", 60) == 2


def test_a_full_table_forgets_the_key_tracked_longest() -> None:
    o = Offers(3, Clock())
    for k in ("k0", "k1", "k2"):
        o.offer("a", k, 60)
    o.offer("a", "k1", 60)  # a later offer does not move a key: the order is of first offers
    o.offer("a", "k3", 60)
    assert o.forgotten == 1 and o.tracked("a") == 3
    assert o.offer("a", "k0", 60) == 1  # forgotten: a first offer again (and k1 forgotten for it)
    assert o.forgotten == 2
    assert o.offer("a", "k2", 60) == 2


def test_stored_and_forgotten_tenants_drop_their_counts() -> None:
    o = Offers(10, Clock())
    o.offer("a", "k", 60)
    o.offer("a", "j", 60)
    o.stored("a", "k")
    assert o.offer("a", "k", 60) == 1 and o.tracked("a") == 2
    o.forget_tenant("a")
    assert o.tracked("a") == 0
    o.stored("nobody", "k")  # nothing to drop: no error
    with pytest.raises(ValueError):
        Offers(0)


def test_counts_saturate_below_the_bits_they_have() -> None:
    o = Offers(10, Clock())
    counts = [o.offer("a", "k", 60) for _ in range(40)]
    assert counts[-1] == 31 and counts[:16] == list(range(1, 17))


class _Tenant:
    def __init__(self, admit_after: int, window: int = 60) -> None:
        self.name = "t"
        self.admit_after = admit_after
        self.admit_window_s = window


def test_admission_declines_counts_and_spares_gateway_blocks() -> None:
    m = Metrics()
    adm = Admission(100, m, Clock())
    t = _Tenant(3)
    for offer in (1, 2):
        with pytest.raises(NotAdmitted) as e:
            adm.check(t, "k", 100)  # type: ignore[arg-type]
        assert e.value.answer() == {"key": "k", "admitted": False, "offers": offer, "admit_after": 3}
    assert adm.check(t, "k", 100)  # type: ignore[arg-type]
    adm.stored(t, "k", 100)  # type: ignore[arg-type]
    assert m.counter("kvstore_tenant_admission_total", tenant="t", result="declined") == 2
    assert m.counter("kvstore_tenant_admission_bytes_total", tenant="t", result="declined") == 200
    assert m.counter("kvstore_tenant_admission_total", tenant="t", result="admitted") == 1
    assert adm.offers.tracked("t") == 0
    # The S3 gateway's blocks and records, and a tenant that admits every block: never counted.
    assert not adm.check(t, "s3~uid~0", 100)  # type: ignore[arg-type]
    assert not adm.check(t, "s3m~bucket~obj", 100)  # type: ignore[arg-type]
    assert not adm.check(_Tenant(1), "k", 100)  # type: ignore[arg-type]
    assert adm.offers.tracked("t") == 0


def test_not_admitted_is_a_202_item_not_an_error_item() -> None:
    e = NotAdmitted("k", 1, 2, 60)
    assert http_status(e) == 202 and not e.retryable
    assert item_answer("k", e) == {"key": "k", "status": 202, "admitted": False, "offers": 1, "admit_after": 2}
    assert "offer 1 of the 2" in str(e)


def test_registry_keeps_admission_and_defaults_it_when_absent(tmp_path: Path) -> None:
    master = MasterKey(os.urandom(32))
    path = tmp_path / "registry.json"
    reg = Registry(path, master)
    reg.create("a", admit_after=2, admit_window_s=600)
    reg.create("b")
    reg.set_limits("b", admit_after=4)
    again = Registry(path, master)
    assert (again.get("a").admit_after, again.get("a").admit_window_s) == (2, 600)
    assert (again.get("b").admit_after, again.get("b").admit_window_s) == (4, DEFAULT_ADMIT_WINDOW_S)
    # A registry written before admission existed (no such fields): every block admitted at its first offer.
    doc = json.loads(path.read_bytes())
    for t in doc["tenants"].values():
        del t["admit_after"], t["admit_window_s"]
    path.write_text(json.dumps(doc))
    old = Registry(path, master)
    assert old.get("a").admit_after == 1 and old.get("a").admit_window_s == DEFAULT_ADMIT_WINDOW_S
    assert old.get("a").public()["admit_after"] == 1
