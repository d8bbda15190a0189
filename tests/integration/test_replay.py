"""``kvstore-bench replay`` against a real daemon (server.py on 127.0.0.1, as
tests/http/conftest.py starts it), on the first few hundred requests of the
shipped Mooncake trace with small blocks, one request at a time:

* a tenant without a quota keeps every block, so every reusable token is
  found: the measured hit ratio equals an independent count over the same
  requests (an id seen in an earlier request is a hit while the chain's ids
  are);
* a tenant with a quota loses its least recently used blocks: the measured
  ratio is the LRU reference's at the blocks it held, within a tolerance
  (the daemon evicts in steps down to 90% of the quota, by record bytes and
  with millisecond access times, where the reference holds a fixed count);
* no wrong byte, no error, and every key of the JSON contract.

No timing is asserted."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvstore_bench import replay
from kvstore_bench.trace import SYNTHETIC

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port

TRACE = SYNTHETIC
CONTRACT = (
    "token_hit_ratio",
    "unbounded_token_hit_ratio",
    "lru_token_hit_ratio",
    "belady_token_hit_ratio",
    "tiers",
    "blocks_held",
    "requests",
    "seconds",
    "wrong_bytes",
    "lookup_ms",
    "load_ms",
)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "data", free_port(), daemon_env(tmp_path, segment_size="4MiB"))
    d.start()
    yield d
    if d.proc is not None:
        assert d.stop() == 0


def _tenant(base: str, name: str, **fields: Any) -> str:
    body = json.dumps({"name": name, "policy": "sealed", **fields}).encode()
    deadline = time.monotonic() + 30
    while True:  # the daemon listens before it is ready
        req = urllib.request.Request(base + "/v1/admin/tenants", body, {"Authorization": f"Bearer {ADMIN}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                token: str = json.load(r)["token"]
                return token
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _replay(base: str, token: str, out: Path, requests: int) -> dict[str, Any]:
    argv = ["--endpoint", base, "--token", token, "--requests", str(requests), "--block-bytes", "4KiB"]
    argv += ["--concurrency", "1", "--no-progress", "--json", str(out)]
    assert replay.main(argv) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def trace_requests(requests: int) -> list[dict[str, Any]]:
    """The first ``requests`` lines of the shipped trace, as JSON."""
    with TRACE.open() as f:
        return [json.loads(line) for line in list(f)[:requests]]


def independent_hit_ratio(requests: int) -> float:
    """Tokens of each request's leading blocks seen in any earlier request, over all
    its input tokens (512 tokens a block, the last one partial)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace_requests(requests):
        n = 0
        while n < len(r["hash_ids"]) and r["hash_ids"][n] in seen:
            n += 1
        hit += min(n * 512, r["input_length"])
        total += r["input_length"]
        seen.update(r["hash_ids"])
    return hit / total


def _check_contract(doc: dict[str, Any], requests: int) -> None:
    missing = [k for k in CONTRACT if k not in doc]
    assert not missing, missing
    assert doc["requests"] == requests and doc["seconds"] > 0
    assert doc["wrong_bytes"] == 0 and doc["errors"] == {}
    assert set(doc["tiers"]) == {"g3", "g4", "miss"}
    assert doc["tiers"]["g4"] == 0  # no object tier here
    assert sum(doc["tiers"].values()) == pytest.approx(1.0)
    for name in ("lookup_ms", "load_ms"):
        assert set(doc[name]) >= {"p50", "p99", "max"}
        assert doc[name]["p50"] <= doc[name]["p99"] <= doc[name]["max"]
    assert doc["lookup_ms"]["count"] == requests


def test_without_a_quota_every_reusable_token_is_found(served: Daemon, tmp_path: Path) -> None:
    token = _tenant(served.base, "open")
    doc = _replay(served.base, token, tmp_path / "open.json", 300)
    _check_contract(doc, 300)
    expected = independent_hit_ratio(300)
    assert expected > 0.02  # the first 300 requests do share prefixes
    assert doc["token_hit_ratio"] == pytest.approx(expected, abs=1e-12)
    assert doc["unbounded_token_hit_ratio"] == pytest.approx(expected, abs=1e-12)
    assert doc["lookup_token_hit_ratio"] == doc["token_hit_ratio"]
    assert doc["blocks_held"] == doc["workload"]["unique_blocks"]  # nothing evicted: LRU and Belady as unbounded
    assert doc["lru_token_hit_ratio"] == doc["belady_token_hit_ratio"] == doc["unbounded_token_hit_ratio"]


def test_with_a_quota_the_hits_are_the_lru_references(served: Daemon, tmp_path: Path) -> None:
    """600 requests hold 13,229 distinct blocks; a 12 MiB quota keeps a fraction of them."""
    token = _tenant(served.base, "quota", quota_bytes=12 << 20)
    doc = _replay(served.base, token, tmp_path / "quota.json", 600)
    _check_contract(doc, 600)
    held, unique = doc["blocks_held"], doc["workload"]["unique_blocks"]
    assert 0 < held < unique / 2
    lru, unbounded = doc["lru_token_hit_ratio"], doc["unbounded_token_hit_ratio"]
    assert lru < unbounded - 0.03  # the quota matters here
    assert doc["token_hit_ratio"] == pytest.approx(lru, abs=0.01)
    assert lru <= doc["belady_token_hit_ratio"] <= unbounded
    assert doc["unbounded_token_hit_ratio"] == pytest.approx(independent_hit_ratio(600), abs=1e-12)


def _admitted_hit_ratio(requests: int, admit_after: int) -> tuple[float, int, int]:
    """The independent count as above, with a tenant that stores a block at
    its ``admit_after``-th offer: (hit ratio, blocks stored, offers declined).
    A request offers each block after its leading blocks found."""
    stored: set[int] = set()
    offers: dict[int, int] = {}
    hit = total = declined = 0
    with TRACE.open() as f:
        for line in list(f)[:requests]:
            r = json.loads(line)
            n = 0
            while n < len(r["hash_ids"]) and r["hash_ids"][n] in stored:
                n += 1
            hit += min(n * 512, r["input_length"])
            total += r["input_length"]
            for h in r["hash_ids"][n:]:
                if h in stored:
                    continue
                offers[h] = offers.get(h, 0) + 1
                if offers[h] >= admit_after:
                    stored.add(h)
                else:
                    declined += 1
    return hit / total, len(stored), declined


def test_admission_costs_the_first_reuse_and_spares_the_blocks_used_once(served: Daemon, tmp_path: Path) -> None:
    """A tenant with admit_after 2 (issue 41): the measured hit ratio, the
    blocks stored and the offers declined are the independent count's, and
    the daemon wrote less than the tenant that stores every block."""
    every = _replay(served.base, _tenant(served.base, "every"), tmp_path / "every.json", 300)
    doc = _replay(served.base, _tenant(served.base, "second", admit_after=2), tmp_path / "second.json", 300)
    _check_contract(doc, 300)
    ratio, stored, declined = _admitted_hit_ratio(300, 2)
    assert doc["token_hit_ratio"] == pytest.approx(ratio, abs=1e-12)
    assert doc["blocks_stored"] == stored and doc["blocks_not_admitted"] == declined
    assert doc["bytes_not_admitted"] == declined * 4096
    assert 0 < doc["token_hit_ratio"] < every["token_hit_ratio"]
    assert doc["blocks_stored"] < every["blocks_stored"] / 2  # most blocks of the trace are used once
    assert doc["daemon_bytes_written"] < every["daemon_bytes_written"] / 2
    assert every["blocks_not_admitted"] == 0


def test_a_daemon_started_here_reports_its_cpu_and_is_removed(tmp_path: Path) -> None:
    """Without --endpoint: a daemon of its own (bench/daemon.py), its CPU counted,
    the chart drawn, the data directory gone afterwards."""
    before = set(Path("/var/tmp").glob("kvstore-bench-*"))
    out, png = tmp_path / "own.json", tmp_path / "own.png"
    argv = ["--requests", "60", "--block-bytes", "4KiB", "--speed", "50", "--no-progress", "--policy", "direct"]
    assert replay.main([*argv, "--prefill-tps", "5000", "--json", str(out), "--png", str(png)]) == 0
    doc = json.loads(out.read_text())
    _check_contract(doc, 60)
    assert doc["daemon_cpu_s"] > 0 and doc["behind_schedule_ms"]["count"] == 60
    assert doc["prefill"]["recompute_s"] == pytest.approx(doc["hit_tokens"] / 5000)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(Path("/var/tmp").glob("kvstore-bench-*")) == before


def test_the_run_keys_are_deleted_from_an_existing_daemon(served: Daemon, tmp_path: Path) -> None:
    token = _tenant(served.base, "clean")
    _replay(served.base, token, tmp_path / "clean.json", 20)
    req = urllib.request.Request(served.base + "/v1/stats", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.load(r)["blocks"] == 0


def test_a_trace_of_its_own_and_a_metrics_token(tmp_path: Path) -> None:
    """A trace given with --trace (an empty prompt among its requests) against a
    daemon whose /metrics wants a token: without it the G3/G4 split is unknown
    (null, and said), with --metrics-token it is read."""
    metrics_token = "metrics-token-for-the-replay-0123"
    d = Daemon(tmp_path / "data", free_port(), daemon_env(tmp_path, metrics_token=metrics_token))
    d.start()
    try:
        token = _tenant(d.base, "own")
        trace = tmp_path / "own.jsonl"
        chains = [(0, 1024, [1, 2]), (5, 0, []), (9, 1100, [1, 2, 3])]
        lines = [{"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids} for t, n, ids in chains]
        trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
        argv = ["--endpoint", d.base, "--token", token, "--trace", str(trace), "--block-bytes", "4KiB"]
        argv += ["--concurrency", "1", "--no-progress"]
        assert replay.main([*argv, "--json", str(tmp_path / "a.json")]) == 0
        doc = json.loads((tmp_path / "a.json").read_text())
        assert doc["token_hit_ratio"] == pytest.approx(1024 / 2124) and doc["errors"] == {}
        assert doc["tiers"] == {"g3": None, "g4": None, "miss": pytest.approx(1100 / 2124)}
        assert any("/metrics" in n and "--metrics-token" in n for n in doc["notes"])
        argv += ["--metrics-token", metrics_token]
        assert replay.main([*argv, "--json", str(tmp_path / "b.json")]) == 0
        doc = json.loads((tmp_path / "b.json").read_text())
        assert doc["tiers"]["g3"] == pytest.approx(1024 / 2124) and doc["tiers"]["g4"] == 0
    finally:
        assert d.stop() == 0


def test_compare_replays_the_same_requests_once_per_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--compare lru,probation``: a fresh daemon per policy (each evicting
    under the quota), one table, and every run's figures in the JSON."""
    out = tmp_path / "compared.json"
    argv = ["--trace", "agents", "--requests", "40", "--block-bytes", "4KiB", "--policy", "direct", "--no-progress"]
    assert replay.main([*argv, "--quota", "256KiB", "--compare", "lru,probation", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "kvstore-bench replay --compare" and list(doc["runs"]) == ["lru", "probation"]
    for run in doc["runs"].values():
        _check_contract(run, 40)
        assert 0 < run["blocks_held"] <= 256 * 1024 // 4096
    table = capsys.readouterr().out.split("policy")[-1].splitlines()
    assert table[0].split()[:3] == ["token", "hit", "LRU"]
    assert [line.split()[0] for line in table[1:3]] == ["lru", "probation"] and table[3] == f"wrote {out}"
