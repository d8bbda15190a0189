"""``kvstore-bench events`` runs end to end on a few blocks: two daemons,
the subscribers' process, the burst, and the in-process rates."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore_bench import cli


def test_events_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "events.json"
    argv = ["events", "--blocks", "20", "--block-size", "4KiB", "--repeats", "1", "--burst", "300"]
    argv += ["--in-process", "5000", "--json", str(out)]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    for name in ("off", "on"):
        assert doc[name]["puts_per_s"] > 0 and doc[name]["get_p99_ms"] > 0
    assert doc["on_vs_off"]["put_mbps"] > 0
    sub = doc["subscriber"]
    assert sub["events"] == 20 + 300 and sub["gaps"] == 0 and sub["zmq_batches"] > 0
    assert min(doc["in_process"].values()) > 0
