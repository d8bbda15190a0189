"""``kvstore-bench writes`` runs end to end on a few small blocks: every
write path it measures stores what it was given (each block read back and
compared), and every figure of every target is there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvstore_bench import cli, write_bench


@pytest.mark.timeout(120)
def test_write_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "writes.json"
    argv = ["writes", "--blocks", "4", "--size", "256KiB", "--depth", "2", "--repeats", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    rows = {r["target"]: r for r in doc["targets"]}
    assert set(rows) == {*write_bench.TARGETS, "get-after-put"}
    for name, r in rows.items():
        assert r["rounds"] == 1 and r["gbps"] > 0 and r["requests_per_s"] > 0, name
        assert math.isfinite(r["vs_loop_direct"]) and r["vs_loop_direct"] > 0, name
        if not name.startswith("loop"):
            assert r["daemon_cpu_s_per_gb"] >= 0, name
    assert rows["loop-direct"]["vs_loop_direct"] == 1.0
    assert set(doc["not_measured"]) == set(write_bench.NOT_BUILT)
    table = capsys.readouterr().out
    assert "÷ loop-direct" in table
    assert ("not measured" in table) == bool(write_bench.NOT_BUILT)
