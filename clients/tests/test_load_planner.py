"""The load planner's choice at fixed bandwidth and prefill figures."""

from __future__ import annotations

import pytest
from kvstore_client.adapters.planner import LoadPlanner

MB = 1_000_000
BLOCK_BYTES = 2 * MB  # a 16-token block of a mid-size model, say
TOKENS = 16


def test_fast_storage_loads_the_whole_hit_under_a_deadline() -> None:
    p = LoadPlanner(prefill_tokens_per_s=8000, margin=1.1)
    plan = p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=2000 * MB)
    assert plan.blocks == 100
    assert plan.load_s == pytest.approx(0.002 + 0.1)
    assert plan.recompute_s == pytest.approx(0.2)
    assert plan.deadline_s == plan.recompute_s  # past it, recomputing would have been sooner


def test_slow_storage_or_a_throttled_tenant_recomputes() -> None:
    p = LoadPlanner(prefill_tokens_per_s=8000, margin=1.1)
    assert p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=500 * MB).blocks == 0  # 0.4 s to load, 0.2 to compute
    # The measured bandwidth is high, the tenant's read limit is not: the limit decides.
    assert p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=5000 * MB, read_limit=50 * MB).blocks == 0
    assert p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=5000 * MB, read_limit=0).blocks == 100


def test_a_read_limit_lets_its_burst_through_at_once() -> None:
    p = LoadPlanner(prefill_tokens_per_s=8000, margin=1.0, overhead_s=0.0)
    # 40 MB at a 50 MB/s limit: 25 MB at once (0.5 s of the rate), then 15 MB at 50 MB/s.
    plan = p.plan(20, TOKENS, BLOCK_BYTES, bandwidth=None, read_limit=50 * MB)
    assert plan.load_s == pytest.approx(0.3)
    # A load smaller than the burst: the measured bandwidth alone decides.
    assert p.plan(5, TOKENS, BLOCK_BYTES, bandwidth=100 * MB, read_limit=50 * MB).load_s == pytest.approx(0.1)
    # The measured bandwidth is lower than the limit allows: it decides.
    assert p.plan(20, TOKENS, BLOCK_BYTES, bandwidth=40 * MB, read_limit=50 * MB).load_s == pytest.approx(1.0)


def test_the_margin_and_the_fixed_cost() -> None:
    p = LoadPlanner(prefill_tokens_per_s=8000, margin=1.0, overhead_s=0.0)
    assert p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=1000 * MB).blocks == 100  # 0.2 s either way: load
    assert LoadPlanner(8000, margin=1.5, overhead_s=0.0).plan(100, TOKENS, BLOCK_BYTES, 1000 * MB).blocks == 0
    # A single block: the fixed cost of a load outweighs its bytes.
    assert LoadPlanner(8000, overhead_s=0.05).plan(1, TOKENS, BLOCK_BYTES, 10_000 * MB).blocks == 0


def test_without_figures_everything_is_loaded_so_the_first_loads_measure() -> None:
    # No prefill figure: nothing to weigh, everything loads with no deadline.
    plan = LoadPlanner(0).plan(7, TOKENS, BLOCK_BYTES, bandwidth=1 * MB)
    assert (plan.blocks, plan.deadline_s) == (7, None)
    # No bandwidth figure: a probe of the whole hit, bounded by the recompute time.
    plan = LoadPlanner(8000).plan(7, TOKENS, BLOCK_BYTES, bandwidth=None)
    assert (plan.blocks, plan.load_s) == (7, None)
    assert plan.deadline_s == pytest.approx(7 * TOKENS / 8000)
    assert LoadPlanner(8000).plan(7, TOKENS, BLOCK_BYTES, bandwidth=None, read_limit=0).deadline_s == plan.deadline_s
    # Only the read limit is known: it is the best case, and it decides.
    assert LoadPlanner(8000).plan(7, TOKENS, BLOCK_BYTES, bandwidth=None, read_limit=1 * MB).blocks == 0
    assert LoadPlanner(8000).plan(0, TOKENS, BLOCK_BYTES, 1 * MB).blocks == 0


def test_prefill_is_measured() -> None:
    p = LoadPlanner()
    p.observe_prefill(4000, 1.0)
    assert p.prefill_tokens_per_s == 4000
    p.observe_prefill(8000, 1.0)
    assert 4000 < p.prefill_tokens_per_s < 8000
    p.observe_prefill(0, 1.0)
    with pytest.raises(ValueError):
        LoadPlanner(margin=0.5)


def test_the_bandwidth_estimate_drops_at_once_rises_gradually_and_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore_client import prefix

    now = [1000.0]
    monkeypatch.setattr(prefix.time, "monotonic", lambda: now[0])
    bw = prefix.Bandwidth()
    bw.record("http://a", "http", 500 * MB, 1.0)
    assert bw.get() == pytest.approx(500 * MB)
    bw.record("http://a", "http", 5 * MB, 1.0)  # the store became 100x slower
    assert bw.get() < 20 * MB  # a plan no longer counts on the old speed
    bw.record("http://a", "http", 500 * MB, 1.0)
    assert 10 * MB < bw.get() < 100 * MB  # one fast load does not undo it
    bw.record("http://a", "http", 100, 1.0)  # too few bytes to say
    now[0] += prefix.STALE_S + 1
    assert bw.get() is None and bw.all() == {}  # stale: the next plan probes again
    bw.record("http://a", "http", 50 * MB, 1.0)
    assert bw.get() == pytest.approx(50 * MB)  # a fresh start, not averaged with the stale figure


def test_a_layerwise_load_is_weighed_with_the_compute_it_overlaps() -> None:
    p = LoadPlanner(prefill_tokens_per_s=8000, margin=1.1, overhead_s=0.0)
    # 100 blocks: 0.2 s to recompute, 0.25 s to load at 800 MB/s: whole-block loading loses...
    assert p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=800 * MB).blocks == 0
    # ...but with 2,000 new tokens (0.25 s) computed beside the load, loading takes 0.25 s against 0.45 s.
    plan = p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=800 * MB, overlap_tokens=2000)
    assert plan.blocks == 100 and plan.deadline_s == pytest.approx(0.45)
    # Far too slow to hide behind the new tokens' compute: recompute.
    assert p.plan(100, TOKENS, BLOCK_BYTES, bandwidth=100 * MB, overlap_tokens=2000).blocks == 0
