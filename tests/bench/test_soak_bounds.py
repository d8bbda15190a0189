"""kvstore-bench soak's bound checker (bench/soak_bounds.py) on series made by
hand: growth past the warm-up is caught, a flat series with allocator noise
passes, growth during the warm-up does not count, and each other bound
(descriptors, threads, a restarted worker, errors, wrong bytes) breaks alone."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore_bench.soak_bounds import Limits, MiB, Series, Verdict, broken, check, growth, spread, warmup_s

END = 300.0  # a 5-minute soak
WARMUP = warmup_s(END)
TIMES = [5.0 * i for i in range(61)]  # a sample every 5 s


def flat(value: float, noise: float = 0.0) -> Series:
    """``value`` with a sawtooth of ``noise`` on top."""
    return [(t, value + noise * ((i % 3) - 1)) for i, t in enumerate(TIMES)]


def worker(
    rss_anon: Series, fds: Series | None = None, threads: Series | None = None, pid: float = 100.0
) -> dict[str, Series]:
    return {
        "rss_anon": rss_anon,
        "fds": fds if fds is not None else flat(60, 2),
        "threads": threads if threads is not None else flat(6),
        "pid": [(t, pid) for t in TIMES],
    }


def failed(verdicts: Sequence[Verdict]) -> set[tuple[str, str]]:
    return {(v.bound, v.subject) for v in broken(verdicts)}


def test_warmup_is_a_fifth_of_the_run_at_most_a_minute() -> None:
    assert warmup_s(120) == 24
    assert warmup_s(300) == 60
    assert warmup_s(3600) == 60


def test_flat_workers_with_allocator_noise_pass() -> None:
    workers = {"writer": worker(flat(110 * MiB, 3 * MiB)), "reader-1": worker(flat(80 * MiB, 2 * MiB))}
    verdicts = check(workers, errors=0, wrong_bytes=0, warmup=WARMUP, end=END)
    assert not broken(verdicts)
    assert {v.bound for v in verdicts} == {
        "rss_anon_growth",
        "fds_spread",
        "threads_spread",
        "restarts",
        "errors",
        "wrong_bytes",
    }


def test_growth_after_the_warmup_is_caught() -> None:
    leak = [(t, 100 * MiB + (t - WARMUP) * 0.2 * MiB if t > WARMUP else 100 * MiB) for t in TIMES]  # 48 MiB by the end
    workers = {"writer": worker(leak), "reader-1": worker(flat(80 * MiB, 2 * MiB))}
    verdicts = check(workers, errors=0, wrong_bytes=0, warmup=WARMUP, end=END)
    assert failed(verdicts) == {("rss_anon_growth", "writer")}
    (v,) = broken(verdicts)
    assert v.value is not None and v.value > Limits().rss_anon_growth
    assert v.line().startswith("rss_anon_growth writer: ") and " > 16 MiB" in v.line()


def test_growth_during_the_warmup_does_not_count() -> None:
    filling = [(t, min(t, WARMUP) * 1 * MiB + 60 * MiB) for t in TIMES]  # 60 MiB of caches filled, then flat
    assert growth(filling, WARMUP, END) == 0
    assert not broken(check({"writer": worker(filling)}, 0, 0, WARMUP, END))


def test_a_spike_early_after_the_warmup_is_not_the_baseline() -> None:
    """The baseline is the median of the first third: one high sample there does not hide a leak."""
    series = [(t, 150 * MiB if t == 70 else 100 * MiB + max(0.0, t - 200) * 0.5 * MiB) for t in TIMES]
    assert growth(series, WARMUP, END) == 50 * MiB


def test_descriptors_and_threads_must_stay_flat() -> None:
    fds = [(t, 60 + (t // 10 if t > WARMUP else 0)) for t in TIMES]  # one more every 10 s
    threads = [(t, 6 + (5 if t > 200 else 0)) for t in TIMES]
    workers = {"writer": worker(flat(100 * MiB), fds=fds), "reader-1": worker(flat(80 * MiB), threads=threads)}
    assert failed(check(workers, 0, 0, WARMUP, END)) == {("fds_spread", "writer"), ("threads_spread", "reader-1")}
    assert spread(fds, WARMUP) == 30  # 60 at the warm-up's end, 90 at the last sample


def test_the_descriptor_limit_counts_the_clients_connections() -> None:
    swing = [(t, 60 + (30 if t > 200 else 0)) for t in TIMES]
    workers = {"writer": worker(flat(100 * MiB), fds=swing)}
    assert failed(check(workers, 0, 0, WARMUP, END)) == {("fds_spread", "writer")}
    assert not broken(check(workers, 0, 0, WARMUP, END, Limits.for_run(16)))


def test_an_object_tier_allows_its_pool_to_fill() -> None:
    threads = [(t, 10 + (7 if t > 250 else 0)) for t in TIMES]  # the S3 pool's threads started late
    workers = {"writer": worker(flat(100 * MiB), threads=threads)}
    assert failed(check(workers, 0, 0, WARMUP, END)) == {("threads_spread", "writer")}
    assert not broken(check(workers, 0, 0, WARMUP, END, Limits.for_run(8, object_tier=True)))


def test_a_replaced_worker_breaks_the_run() -> None:
    w = worker(flat(100 * MiB))
    w["pid"] = [(t, 100.0 if t < 150 else 200.0) for t in TIMES]
    assert failed(check({"reader-1": w}, 0, 0, WARMUP, END)) == {("restarts", "reader-1")}


def test_errors_and_wrong_bytes_break_the_run() -> None:
    workers = {"writer": worker(flat(100 * MiB))}
    assert failed(check(workers, 1, 0, WARMUP, END)) == {("errors", "run")}
    assert failed(check(workers, 0, 17, WARMUP, END)) == {("wrong_bytes", "run")}


def test_too_few_samples_are_not_measured_and_hold() -> None:
    short = [(t, 100 * MiB * (1 + t)) for t in (0.0, 70.0)]  # one sample after the warm-up
    (v, *_) = check({"writer": worker(short)}, 0, 0, WARMUP, END)
    assert v.bound == "rss_anon_growth" and v.value is None and v.ok
    assert v.line() == "rss_anon_growth writer: not measured"
