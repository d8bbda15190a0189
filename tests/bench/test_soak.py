"""kvstore-bench soak in CI: five minutes of the mixed load against a daemon
with two workers that the command starts, with its bounds checked (``--check``):
no growth of anonymous RSS past the warm-up, descriptors and threads flat,
no error, no wrong byte. The 60-minute soak is the same command with
``--minutes 60``, run by hand on a quiet machine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

MINUTES = 5
# The console script beside this interpreter (the checkout's venv, or an installed wheel's).
BENCH_COMMAND = Path(sys.executable).with_name("kvstore-bench")


@pytest.mark.slow
@pytest.mark.timeout(MINUTES * 60 + 120)
def test_five_minute_soak_holds_its_bounds(tmp_path: Path) -> None:
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    t0 = time.monotonic()
    r = subprocess.run(
        [
            str(BENCH_COMMAND),
            "soak",
            "--minutes",
            str(MINUTES),
            "--workers",
            "2",
            "--check",
            "--json",
            str(out),
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=MINUTES * 60 + 90,
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-5000:]}"
    assert took < MINUTES * 60 + 30, f"the soak took {took:.0f} s"
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["ok"] is True
    assert summary["errors"] == 0 and summary["wrong_bytes"] == 0, summary["error_messages"]
    assert summary["seconds"] >= MINUTES * 60 - 1
    assert summary["hits"] > 1000 and summary["misses"] > 0  # it read, and the quota and the TTL took blocks
    assert all(op["n"] > 0 for op in summary["ops"].values()), summary["ops"]
    assert set(summary["workers"]) == {"supervisor", "writer", "reader-1"}
    bounds = {(b["bound"], b["subject"]): b for b in summary["bounds"]}
    for role in ("writer", "reader-1"):
        for bound in ("rss_anon_growth", "fds_spread", "threads_spread", "restarts"):
            assert bounds[(bound, role)]["value"] is not None, (bound, role)  # measured, not skipped
            assert bounds[(bound, role)]["ok"], bounds[(bound, role)]
    whats = [e["what"] for e in doc["events"]]
    assert whats.count("flush") >= 4 and whats.count("compact") >= 4 and whats.count("SIGHUP") >= 3, whats
    assert any(w.startswith("quota") for w in whats) and any(w.startswith("ttl") for w in whats)
    assert all(e["ok"] for e in doc["events"]), doc["events"]
    assert len(doc["samples"]) >= MINUTES * 60 // 5
    assert summary["daemon_exit_status"] == 0  # stopped cleanly with SIGTERM at the end
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
