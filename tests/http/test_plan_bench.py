"""bench/plan_bench.py runs end to end on a few small blocks: a daemon with a
unix socket, read plans, raw preadv and HTTP over the same socket."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore_bench import plan_bench


def test_plan_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert (
        plan_bench.main(
            ["--blocks", "4", "--block-size", "256KiB", "--batch", "3", "--repeats", "1", "--json", str(out)]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["blocks"] == 4 and doc["plan_ms"] > 0
    for cache in ("warm", "cold"):
        assert set(doc[cache]) == {"preadv", "plan", "http"} and min(doc[cache].values()) > 0
