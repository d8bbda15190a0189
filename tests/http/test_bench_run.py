"""``kvstore-bench run`` end to end: it starts a real daemon (and Redis when installed),
or measures one already running (``--endpoint``).

Checks the shape of what it writes (JSON keys, non-negative numbers, a time
series, a PNG), never the speed; and that a run against an existing daemon
leaves nothing in its tenant.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvstore_bench.cli import main
from kvstore_bench.http_bench import Kvstore, Processes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RESULT_KEYS = {
    "elapsed_s",
    "ops",
    "gbps",
    "read_gbps",
    "write_gbps",
    "blocks_per_s",
    "tokens_per_s",
    "hits",
    "misses",
    "errors",
    "latency",
    "timeseries",
}


def numbers(doc: Any) -> list[float]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, int | float):
        return [doc]
    if isinstance(doc, dict):
        return [n for v in doc.values() for n in numbers(v)]
    if isinstance(doc, list):
        return [n for v in doc for n in numbers(v)]
    return []


def check_result(r: dict[str, Any]) -> None:
    assert r.keys() >= RESULT_KEYS
    assert r["ops"] > 0
    assert r["hits"] > 0
    assert r["error_count"] == 0, r["errors"]
    for op in ("get", "get_miss", "put"):
        assert {"count", "p50_ms", "p90_ms", "p99_ms"} <= r["latency"][op].keys()
    assert r["latency"]["get"]["p50_ms"] is not None
    assert r["timeseries"]
    for point in r["timeseries"]:
        assert {"t_s", "gbps", "ops_per_s", "p50_ms", "p99_ms"} <= point.keys()


def run_short(tmp_path: Path, peers: str) -> dict[str, Any]:
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    argv = ["run", "--short", "--hit-ratio", "0.8", "--json", str(out_json), "--png", str(out_png)]
    assert main([*argv, "--no-progress", "--peers", peers]) == 0
    doc: dict[str, Any] = json.loads(out_json.read_text())
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE
    assert all(n >= 0 for n in numbers(doc))
    return doc


def test_run_short_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_short(tmp_path, "none")
    assert {"workload", "results", "ratios", "formulas", "ttft", "skipped", "notes"} <= doc.keys()
    assert list(doc["results"]) == ["kvstore"]
    check_result(doc["results"]["kvstore"])
    assert doc["results"]["kvstore"]["misses"] > 0
    w = doc["workload"]
    assert w["block_bytes"] == 32 * 2 * 8 * 128 * 2 * 16  # Llama-3.1-8B, tp 1, 16 tokens per block (--short)
    assert doc["ttft"]["load_s"] > 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "tokens/s" in out and "TTFT model" in out


@pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server not installed (apt-get install -y redis-server)"
)
def test_run_short_with_redis(tmp_path: Path) -> None:
    doc = run_short(tmp_path, "redis")
    check_result(doc["results"]["redis"])
    assert doc["results"]["redis"]["writes"] > 0
    assert "read_gbps" in doc["ratios"]["redis"]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--read-ratio", "1.5"], "--read-ratio"),
        (["--hit-ratio", "-0.1"], "--hit-ratio"),
        (["--peers", "memcached"], "--peers"),
        (["--tp", "3"], "--tp"),
        (["--model", "gpt-9"], "--model"),
        (["--concurrency", "0"], "--concurrency"),
        (["--duration", "5", "--ops", "10"], "--ops"),
        (["--token", "t"], "--token"),
        (["--endpoint", "http://127.0.0.1:1"], "--token"),
        (["--endpoint", "ftp://x", "--token", "t"], "--endpoint"),
        (["--endpoint", "http://127.0.0.1:1", "--token", "t", "--policy", "direct"], "--policy"),
        (["--keep"], "--keep"),
    ],
)
def test_run_bad_options_exit_2(argv: list[str], option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--short", *argv])
    assert exc.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


@dataclass
class Existing:
    """A daemon this test started, and a tenant in it, for ``run --endpoint``."""

    base: str
    token: str

    def get(self, path: str) -> Any:
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def keys(self) -> list[str]:
        doc = self.get("/v1/keys?limit=10000")
        assert doc["next_start_after"] is None
        return [e["key"] for e in doc["keys"]]


@pytest.fixture
def existing(tmp_path: Path) -> Iterator[Existing]:
    procs = Processes()
    (tmp_path / "kv").mkdir()
    try:
        kv = Kvstore(procs, tmp_path / "kv", "interval")
        kv.start(1)
        yield Existing(f"http://127.0.0.1:{kv.port}", kv.create_tenant("mine", "direct"))
    finally:
        procs.stop_all()


def run_endpoint(existing: Existing, *extra: str) -> None:
    argv = ["run", "--short", "--endpoint", existing.base, "--token", existing.token, "--ops", "60"]
    argv += ["--read-ratio", "0.5", "--no-progress", "--peers", "none", *extra]
    assert main(argv) == 0


def test_run_against_an_endpoint_removes_what_it_stored(existing: Existing, capsys: pytest.CaptureFixture[str]) -> None:
    """It used to leave its loaded blocks and every write in the tenant, with a note saying so."""
    urllib.request.urlopen(  # the tenant's own block, which the run must not touch
        urllib.request.Request(
            existing.base + "/v1/blocks/mine-1",
            data=b"x" * 4096,
            method="PUT",
            headers={"Authorization": f"Bearer {existing.token}"},
        ),
        timeout=30,
    ).close()
    run_endpoint(existing)
    out = capsys.readouterr().out
    assert existing.keys() == ["mine-1"]
    assert existing.get("/v1/stats")["blocks"] == 1
    assert "were deleted" in out


def test_run_against_an_endpoint_keeps_its_blocks_with_keep(
    existing: Existing, capsys: pytest.CaptureFixture[str]
) -> None:
    run_endpoint(existing, "--keep")
    keys = existing.keys()
    run_prefix = keys[0][: len("bench-12345678-")]
    assert all(k.startswith(run_prefix) for k in keys)
    loaded = [k for k in keys if re.fullmatch(r"bench-[0-9a-f]{8}-\d{6}", k)]
    assert len(loaded) == 8  # --short's blocks; the writes are the rest
    assert len(keys) > len(loaded)
    assert "--keep" in capsys.readouterr().out
