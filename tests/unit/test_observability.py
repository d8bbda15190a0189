"""deploy/grafana/kvstore.json and deploy/prometheus/alerts.yml: they load,
and every query names a metric the daemon exports (the names its code
records), so a renamed metric cannot leave a dead panel or a silent alert.
The rules go through ``promtool check rules`` where Prometheus's tooling
is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RECORDED = re.compile(r"""\.(?:inc|set|observe)\(\s*["'](kvstore_[a-z0-9_]+)["']""")
# A name recorded through a module's constant (``VERSION_METRIC = "kvstore_..."``, then ``.set(VERSION_METRIC``).
CONSTANT = re.compile(r"""^([A-Z][A-Z0-9_]*)\s*=\s*["'](kvstore_[a-z0-9_]+)["']""", re.MULTILINE)
NAME = re.compile(r"\bkvstore_[a-z0-9_]+\b")


def exported() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "kvstore").rglob("*.py"):
        text = path.read_text()
        names |= set(RECORDED.findall(text))
        for constant, name in CONSTANT.findall(text):
            if re.search(rf"\.(?:inc|set|observe)\(\s*{constant}\b", text):
                names.add(name)
    histograms = {n for n in names if n.endswith(("_seconds", "_records", "_bytes"))}
    return names | {h + suffix for h in histograms for suffix in ("_bucket", "_sum", "_count")}


def balanced(expr: str) -> bool:
    depth = {"(": 0, "{": 0, "[": 0}
    pairs = {")": "(", "}": "{", "]": "["}
    for ch in re.sub(r'"[^"]*"', "", expr):
        if ch in depth:
            depth[ch] += 1
        elif ch in pairs:
            depth[pairs[ch]] -= 1
            if depth[pairs[ch]] < 0:
                return False
    return all(v == 0 for v in depth.values())


def test_the_code_records_the_metrics_it_is_known_for() -> None:
    names = exported()
    assert {"kvstore_http_requests_total", "kvstore_events_total", "kvstore_workers"} <= names
    assert "kvstore_http_request_seconds_bucket" in names
    assert {"kvstore_fleet_members", "kvstore_fleet_fenced", "kvstore_fleet_adopted_blocks"} <= names
    assert "kvstore_fleet_takeover_seconds_bucket" in names


def test_dashboard_queries_name_exported_metrics() -> None:
    doc: dict[str, Any] = json.loads((ROOT / "deploy/grafana/kvstore.json").read_text())
    names = exported()
    everything = doc["panels"]
    assert len({p["id"] for p in everything}) == len(everything)
    rows = [p for p in everything if p["type"] == "row"]  # a row's title heads the panels below it
    assert all(not p.get("targets") and p["gridPos"]["w"] == 24 for p in rows)
    panels = [p for p in everything if p["type"] != "row"]
    assert doc["title"] and len(panels) >= 10
    titles = {p["title"] for p in panels}
    for wanted in ("Throughput", "p99 latency by route", "Hit rate", "Upload backlog", "Errors", "Compaction"):
        assert wanted in titles
    fleet = next(r for r in rows if r["title"].startswith("Fleet"))
    below = " ".join(t["expr"] for p in panels if p["gridPos"]["y"] > fleet["gridPos"]["y"] for t in p["targets"])
    for name in (
        "kvstore_fleet_members",
        "kvstore_fleet_fenced",
        "kvstore_fleet_registry_version",
        "kvstore_fleet_adopted_blocks",
        "kvstore_fleet_takeover_seconds_bucket",
    ):
        assert name in below, name
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            used = set(NAME.findall(t["expr"]))
            assert used, (p["title"], t["expr"])
            assert used <= names, (p["title"], used - names)
            assert balanced(t["expr"]), t["expr"]
    assert "kvstore_workers" in json.dumps(doc["templating"])


def test_alert_rules_parse_and_name_exported_metrics() -> None:
    path = ROOT / "deploy/prometheus/alerts.yml"
    doc = yaml.safe_load(path.read_text())
    names = exported()
    rules = [r for g in doc["groups"] for r in g["rules"]]
    alerts = {r["alert"] for r in rules}
    assert {
        "KvstoreDiskOverHighWatermark",
        "KvstoreUploadBacklogGrowing",
        "KvstoreObjectTierUnreachable",
        "KvstoreCorruption",
        "KvstoreHigh5xxRate",
        "KvstoreEventSubscribersDropping",
        "KvstoreFleetNodeFenced",
        "KvstoreFleetMemberDead",
    } <= alerts
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        used = set(NAME.findall(r["expr"]))
        assert used and used <= names, (r["alert"], used - names)
        assert balanced(r["expr"]), r["expr"]
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["for"]


def test_alert_rules_pass_promtool() -> None:
    path = ROOT / "deploy/prometheus/alerts.yml"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (tests/run.sh installs it as root): the schema test checked the rules")
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_fleet_alerts_fire_when_promtool_says_they_do(tmp_path: Path) -> None:
    """``promtool test rules``: a node fenced for two minutes fires
    KvstoreFleetNodeFenced, a fence of 30 s does not; a member dead for
    15 minutes fires KvstoreFleetMemberDead once for the fleet (not once per
    node reporting it), 5 minutes do not."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (tests/run.sh installs it as root)")
    tests = {
        "rule_files": [str(ROOT / "deploy/prometheus/alerts.yml")],
        "evaluation_interval": "30s",
        "tests": [
            {
                "interval": "30s",
                "input_series": [
                    {"series": 'kvstore_fleet_fenced{job="kv",instance="n0"}', "values": "0 1x5"},
                    {"series": 'kvstore_fleet_fenced{job="kv",instance="n1"}', "values": "0 1 0x5"},
                    {"series": 'kvstore_fleet_members{job="kv",instance="n0",state="dead"}', "values": "1x40"},
                    {"series": 'kvstore_fleet_members{job="kv",instance="n2",state="dead"}', "values": "1x40"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "2m30s",
                        "alertname": "KvstoreFleetNodeFenced",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical", "instance": "n0"},
                                "exp_annotations": {
                                    "summary": "kvstore n0: fenced for over a minute: it refuses writes"
                                    " (see /readyz and its log: can it reach the bucket?)"
                                },
                            }
                        ],
                    },
                    {"eval_time": "5m", "alertname": "KvstoreFleetMemberDead", "exp_alerts": []},
                    {
                        "eval_time": "15m",
                        "alertname": "KvstoreFleetMemberDead",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "job": "kv"},
                                "exp_annotations": {
                                    "summary": "kvstore fleet kv: 1 member(s) dead for 10 minutes:"
                                    " bring them back, or decommission them"
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "fleet_alerts_test.yml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
