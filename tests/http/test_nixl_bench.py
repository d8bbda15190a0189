"""``kvstore-bench nixl`` runs end to end on a few small blocks: a daemon
with its NIXL agent, reads over NIXL (single and batched), HTTP GET and a
socket copy, each figure present and each ratio computed from its round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvstore_bench import cli
from kvstore_client.nixl import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (tests/run.sh installs it)")


def test_nixl_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "nixl.json"
    argv = ["nixl", "--blocks", "4", "--block-size", "256KiB", "--depth", "2", "--repeats", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["blocks"] == 4 and doc["socket"]["gbps"] > 0
    for row in ("nixl@1", "nixl@2", "nixl-many@2", "http@1", "http@2"):
        r = doc[row]
        assert r["gbps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] and r["vs_http"] > 0 and r["vs_socket"] > 0, row
    assert doc["http@2"]["vs_http"] == 1.0
