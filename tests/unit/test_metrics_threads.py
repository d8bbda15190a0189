"""kvstore/metrics.py: the thread that made a Metrics (the event loop's)
records without the lock, the others with it; every reading (counter,
snapshot, render, without_label, merged) adds both, and nothing is lost
when threads record at once."""

from __future__ import annotations

import threading

from kvstore.metrics import Metrics, merged


def test_the_owner_and_other_threads_add_up_exactly() -> None:
    m = Metrics()
    per_thread, threads = 20_000, 4

    def record() -> None:
        for _ in range(per_thread):
            m.inc("kvstore_test_total", route="/r", method="GET")
            m.observe("kvstore_test_seconds", 0.001, route="/r")

    workers = [threading.Thread(target=record) for _ in range(threads)]
    for t in workers:
        t.start()
    record()  # the owner, meanwhile
    for t in workers:
        t.join()
    want = per_thread * (threads + 1)
    assert m.counter("kvstore_test_total", method="GET", route="/r") == want  # (labels in any order)
    snap = m.snapshot()
    assert [c[2] for c in snap["counters"] if c[0] == "kvstore_test_total"] == [want]
    (hist,) = [h for h in snap["hists"] if h[0] == "kvstore_test_seconds"]
    assert hist[5] == want and sum(hist[3]) == want
    text = m.render()
    assert f'kvstore_test_total{{method="GET",route="/r"}} {want}' in text
    assert f'kvstore_test_seconds_count{{route="/r"}} {want}' in text
    assert m.without_label("route").counter("kvstore_test_total", method="GET") == want
    assert merged([snap, snap], frozenset()).counter("kvstore_test_total", method="GET", route="/r") == 2 * want


def test_a_series_is_one_whichever_order_its_labels_come_in() -> None:
    m = Metrics()
    m.inc("kvstore_x_total", a="1", b="2")
    m.inc("kvstore_x_total", b="2", a="1")
    assert m.counter("kvstore_x_total", a="1", b="2") == 2
    assert m.render().count("kvstore_x_total{") == 1
