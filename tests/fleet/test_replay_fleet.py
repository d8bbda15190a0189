"""``kvstore-bench replay --fleet``: the shipped Mooncake trace replayed
through a fleet client into a fleet of two daemons on one S3 endpoint
(moto's server), one request at a time, small blocks:

* against a running fleet (``--fleet --endpoint <one seed>``) the client
  finds the other member by itself; a tenant without a quota keeps every
  block, so every reusable token is found (the hit ratio is the unbounded
  reference's), no byte is wrong, each member holds exactly the keys the
  rendezvous hashing gives it (blocks on both nodes), ``blocks_held`` is the
  sum over the members, every member's /metrics is read, and the run's keys
  are gone from every node afterwards;
* with ``--fleet --nodes 2`` the command starts its own fleet, reports the
  nodes' CPU and removes everything;
* the options that make no sense together are argparse errors, before
  anything starts.

No timing is asserted."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvstore_bench import replay
from kvstore_bench.replayer import block_key
from kvstore_client.sharding import rank_endpoints

from ..integration.test_replay import independent_hit_ratio, trace_requests
from ..moto_s3 import S3Env
from .test_daemons import Fleet, call

REQUESTS = 150
BLOCK = 16 << 10
# One worker a node; a node slowed by the replay on a small machine must not be declared dead mid-run.
NODE_SETTINGS = {"workers": "1", "fleet_dead_after_s": "10"}


@pytest.fixture
def two_nodes(tmp_path: Path, s3: S3Env) -> Iterator[Fleet]:
    f = Fleet(tmp_path, s3, 2, **NODE_SETTINGS)
    try:
        f.start()
        yield f
    finally:
        f.stop()


def _run_id(notes: list[str]) -> str:
    """The run's id, from the note that says its keys were deleted from every member."""
    said = [m.group(1) for n in notes if (m := re.search(r"\(bench-([0-9a-f]{8})-\*\) were deleted from every", n))]
    assert len(said) == 1, notes
    return said[0]


def _blocks(base: str, token: str) -> int:
    r = call(base, "GET", "/v1/stats", token)
    assert r.status == 200, r
    blocks: int = r.body["blocks"]
    return blocks


def test_a_running_fleet_from_one_seed_finds_every_token_and_is_cleaned(two_nodes: Fleet, tmp_path: Path) -> None:
    n0, n1 = two_nodes.nodes
    t = call(n0.base, "POST", "/v1/admin/tenants", doc={"name": "open", "policy": "sealed"})
    assert t.status == 201, t
    token = t.body["token"]
    two_nodes.wait_token(token)
    out = tmp_path / "fleet.json"
    argv = ["--fleet", "--endpoint", n0.base, "--token", token, "--requests", str(REQUESTS)]
    argv += ["--block-bytes", "16KiB", "--concurrency", "1", "--no-progress", "--json", str(out)]
    assert replay.main(argv) == 0
    doc = json.loads(out.read_text())

    assert doc["requests"] == REQUESTS and doc["wrong_bytes"] == 0 and doc["errors"] == {}
    expected = independent_hit_ratio(REQUESTS)
    assert expected > 0.02  # the first requests do share prefixes
    assert doc["token_hit_ratio"] == pytest.approx(expected, abs=1e-12)
    assert doc["unbounded_token_hit_ratio"] == pytest.approx(expected, abs=1e-12)
    assert doc["lru_token_hit_ratio"] == doc["belady_token_hit_ratio"] == doc["unbounded_token_hit_ratio"]

    fleet = doc["fleet"]
    urls = sorted(d.base for d in two_nodes.nodes)
    assert fleet["members"] == 2 and not fleet["started_here"] and fleet["seeds"] == [n0.base]
    assert sorted(fleet["member_urls"]) == urls  # the second member found from the seed
    # Each member holds exactly the keys the rendezvous hashing places on it: blocks on both nodes.
    run_id = _run_id(doc["notes"])
    owned = dict.fromkeys(urls, 0)
    for h in {h for r in trace_requests(REQUESTS) for h in r["hash_ids"]}:
        owned[rank_endpoints(urls, block_key(f"bench-{run_id}-", h))[0]] += 1
    assert fleet["blocks_held_by_member"] == owned
    assert all(n > 0 for n in owned.values())
    assert doc["blocks_held"] == sum(owned.values()) == doc["workload"]["unique_blocks"]
    assert doc["tiers"]["g3"] is not None  # every member's /metrics answered (summed)
    assert doc["daemon_bytes_written"] > 0
    assert any("quota is enforced by each node on its own shard" in n for n in doc["notes"])

    assert _blocks(n0.base, token) == 0 and _blocks(n1.base, token) == 0  # gone from every node


def test_a_fleet_started_here_reports_its_nodes_and_is_removed(tmp_path: Path) -> None:
    """--fleet --nodes 2: moto's server and two nodes of its own (fleet_bench's local_fleet), the
    nodes' CPU summed, the directory gone afterwards."""
    before = set(Path("/var/tmp").glob("kvstore-bench-replay-fleet-*"))
    out = tmp_path / "started.json"
    argv = ["--fleet", "--nodes", "2", "--requests", "60", "--block-bytes", "16KiB", "--concurrency", "1"]
    assert replay.main([*argv, "--policy", "direct", "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["wrong_bytes"] == 0 and doc["errors"] == {}
    assert doc["token_hit_ratio"] == pytest.approx(independent_hit_ratio(60), abs=1e-12)
    fleet = doc["fleet"]
    assert fleet["members"] == 2 and fleet["started_here"] and fleet["seeds"] is None
    held = fleet["blocks_held_by_member"]
    assert len(held) == 2 and all(n > 0 for n in held.values())
    assert doc["blocks_held"] == sum(held.values()) == doc["workload"]["unique_blocks"]
    assert doc["daemon_cpu_s"] > 0 and "daemon_cpu_s" in fleet["summed_over_members"]
    assert doc["workload"]["nodes"] == 2 and doc["workload"]["policy"] == "direct"
    assert set(Path("/var/tmp").glob("kvstore-bench-replay-fleet-*")) == before


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--endpoint", "http://127.0.0.1:1,http://127.0.0.1:2", "--token", "t"],
            "argument --endpoint: 2 URLs, but one daemon takes one: several are the seeds of a fleet (add --fleet)",
        ),
        (["--fleet"], "argument --fleet: needs --endpoint URL[,URL...] (a running fleet's seeds) or --nodes N"),
        (["--nodes", "2"], "argument --nodes: only with --fleet"),
        (["--fleet", "--nodes", "1"], "argument --nodes: a fleet started here needs at least 2 nodes, got 1"),
        (
            ["--fleet", "--nodes", "2", "--endpoint", "http://127.0.0.1:1", "--token", "t"],
            "argument --nodes: only for a fleet this command starts (not with --endpoint)",
        ),
        (
            ["--fleet", "--endpoint", "http://127.0.0.1:1,127.0.0.1:2", "--token", "t"],
            "argument --endpoint: '127.0.0.1:2' is not an http:// or https:// URL",
        ),
        (
            ["--fleet", "--endpoint", "http://127.0.0.1:1,http://127.0.0.1:1", "--token", "t"],
            "names a URL twice",
        ),
        (
            ["--fleet", "--endpoint", "http://127.0.0.1:1", "--token", "t", "--quota", "1MiB"],
            "argument --quota: only for a daemon this command starts (not with --endpoint)",
        ),
    ],
)
def test_options_that_do_not_go_together_are_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        replay.main(argv)
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_a_started_fleet_without_moto_says_so_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "moto.server", None)  # (an import of it now fails)
    with pytest.raises(SystemExit) as e:
        replay.main(["--fleet", "--nodes", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --nodes: needs moto's S3 server (no module 'moto.server'); install it with: " in err
    assert f"{sys.executable} -m pip install 'moto[server]>=5'" in err
