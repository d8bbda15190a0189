"""``kvstore admin`` run as a user runs it (the installed command, a process
of its own) against a real daemon of two workers: every subcommand, its
``--json`` answer parsed and its human output read for its columns, and the
failures with their one line and exit status: a wrong token, an
unreachable URL, an unknown tenant, a bad value (refused by the command
before anything is sent, or by the daemon), damage found by verify.

The usage the tenant list shows comes from the daemon's counters; the hits
of a read served by a reader worker reach the writer's answer within the
workers' metrics snapshots (0.5 s): polled, never slept for.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.http.admincli import admin, failed
from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port
from tests.polling import until


def http(base: str, method: str, path: str, token: str, data: bytes | None = None) -> int:
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("admin-cli")
    d = Daemon(tmp / "data", free_port(), daemon_env(tmp, workers="2", segment_size="1MiB", frame_size="64KiB"))
    d.start()
    try:
        yield d
    finally:
        d.stop()


async def test_tenants_are_created_listed_with_usage_and_hits_shown_changed_and_deleted(daemon: Daemon) -> None:
    url = daemon.base
    made = admin(url, "tenants", "create", "acme", "--quota", "1GiB", "--ttl", "12h", "--weight", "7")
    assert made.code == 0, made.err
    token = made.out.strip()  # the token alone on stdout: TOKEN=$(kvstore admin tenants create NAME)
    assert re.fullmatch(r"kvs_[A-Za-z0-9_-]+", token), made.out
    assert "shown once" in made.err
    assert http(url, "PUT", "/v1/blocks/k1", token, b"x" * 5000) == 201
    assert http(url, "GET", "/v1/blocks/k1", token) == 200
    assert http(url, "GET", "/v1/blocks/nope", token) == 404
    assert http(url, "POST", "/v1/lookup", token, json.dumps({"keys": ["k1", "k2", "k3"]}).encode()) == 200

    def acme() -> dict[str, Any]:
        tenants = admin(url, "tenants", "list", "--json").doc()["tenants"]
        return next(t for t in tenants if t["name"] == "acme")

    # (each request may have been served by either worker, each on its own
    # connection: a reader's counts reach the writer within 0.5 s)
    def counted() -> bool:
        hits = acme()["hits"]
        return bool(hits["reads"] == {"hit": 1, "miss": 1} and hits["prefix_blocks"] == {"hit": 1, "miss": 2})

    await until("acme's hits in the list", counted)
    listed = acme()
    assert listed["blocks"] == 1 and listed["bytes_logical"] == 5000 and listed["bytes_stored"] > 0
    assert listed["quota_bytes"] == 1 << 30 and listed["ttl_s"] == 12 * 3600 and listed["qos"]["weight"] == 7
    assert listed["hits"]["prefix_blocks"] == {"hit": 1, "miss": 2}

    table = admin(url, "tenants", "list")
    assert table.code == 0, table.err
    head, *rows = table.out.splitlines()
    columns = ["NAME", "POLICY", "BLOCKS", "STORED", "QUOTA", "TTL", "READ HITS", "READ MISSES", "PREFIX HITS"]
    assert re.split(r"\s{2,}", head) == columns
    row = next(r for r in rows if r.startswith("acme "))
    assert row.split()[:2] == ["acme", "sealed"] and "1.0 GiB" in row and "12h" in row and row.endswith("33.3%"), row

    shown = admin(url, "tenants", "show", "acme")
    assert shown.code == 0, shown.err
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in shown.out.splitlines())
    assert lines["name"] == "acme" and lines["blocks"] == "1" and lines["quota"] == "1.0 GiB"
    assert lines["read hits"] == "1 of 2 block reads (50.0%)" and lines["ttl"] == "12h"
    assert lines["tokens"] == listed["tokens"][0]["id"]
    assert admin(url, "tenants", "show", "acme", "--json").doc()["blocks"] == 1

    patched = admin(
        url,
        "--json",
        "tenants",
        "patch",
        "acme",
        "--quota",
        "none",
        "--ttl",
        "30m",
        "--admit-after",
        "2",
        "--eviction",
        "lru",
    ).doc()
    assert patched["quota_bytes"] is None and patched["ttl_s"] == 1800 and patched["admit_after"] == 2
    assert patched["eviction"] == "lru"
    assert "eviction      lru" in admin(url, "tenants", "show", "acme").out
    assert patched["qos"]["weight"] == 7  # (not named: unchanged)
    reset = admin(
        url, "tenants", "patch", "acme", "--qos-defaults", "--admit-after", "default", "--eviction", "default", "--json"
    ).doc()
    assert reset["qos"]["weight"] == 100 and reset["admit_after"] == 1 and reset["eviction"] is None
    human = admin(url, "tenants", "patch", "acme", "--frame-size", "256KiB")
    assert human.code == 0 and "frame size    256.0 KiB" in human.out, human.out

    rotated = admin(url, "tenants", "rotate-key", "acme")
    assert rotated.code == 0 and "data key version 2" in rotated.out, rotated
    gone = admin(url, "tenants", "delete", "acme")
    assert gone.code == 0 and "deleted tenant acme" in gone.out, gone
    assert http(url, "GET", "/v1/blocks/k1", token) == 401
    assert all(t["name"] != "acme" for t in admin(url, "tenants", "list", "--json").doc()["tenants"])


def test_tokens_are_issued_listed_and_revoked(daemon: Daemon) -> None:
    url = daemon.base
    first = admin(url, "tenants", "create", "tok", "--policy", "direct").out.strip()
    issued = admin(url, "tokens", "issue", "tok", "--json").doc()
    assert issued["name"] == "tok" and issued["token"] != first
    assert http(url, "PUT", "/v1/blocks/a", issued["token"], b"a" * 100) == 201
    listed = admin(url, "tokens", "list", "tok")
    assert listed.code == 0 and listed.out.splitlines()[0].split() == ["TOKEN", "ID", "CREATED"]
    assert issued["token_id"] in listed.out and len(listed.out.splitlines()) == 3  # the header and two tokens
    human = admin(url, "tokens", "issue", "tok")
    assert re.fullmatch(r"kvs_[A-Za-z0-9_-]+", human.out.strip()) and "shown once" in human.err
    revoked = admin(url, "tokens", "revoke", "tok", issued["token_id"])
    assert revoked.code == 0 and issued["token_id"] in revoked.out
    assert http(url, "GET", "/v1/blocks/a", issued["token"]) == 401
    assert http(url, "GET", "/v1/blocks/a", first) == 200
    failed(admin(url, "tokens", "revoke", "tok", "0123456789abcdef"), 1, "404")


def test_s3_keys_are_issued_listed_and_revoked(daemon: Daemon) -> None:
    url = daemon.base
    assert admin(url, "tenants", "create", "s3t").code == 0
    assert admin(url, "s3-keys", "list", "s3t").out.strip() == "tenant s3t has no S3 keys"
    human = admin(url, "s3-keys", "issue", "s3t")
    assert human.code == 0 and "shown once" in human.err
    pairs = dict(line.split() for line in human.out.splitlines())
    assert set(pairs) == {"access_key_id", "secret_access_key"} and len(pairs["secret_access_key"]) == 40
    doc = admin(url, "s3-keys", "issue", "s3t", "--json").doc()
    listed = admin(url, "s3-keys", "list", "s3t", "--json").doc()
    assert {k["access_key_id"] for k in listed["s3_keys"]} == {pairs["access_key_id"], doc["access_key_id"]}
    table = admin(url, "s3-keys", "list", "s3t").out.splitlines()
    assert table[0].split() == ["ACCESS", "KEY", "ID", "CREATED"] and len(table) == 3
    assert admin(url, "s3-keys", "revoke", "s3t", doc["access_key_id"]).code == 0
    after = admin(url, "s3-keys", "list", "s3t", "--json").doc()
    assert [k["access_key_id"] for k in after["s3_keys"]] == [pairs["access_key_id"]]


def test_status_names_the_build_the_workers_the_disk_and_the_fence(daemon: Daemon) -> None:
    url = daemon.base
    doc = admin(url, "status", "--json").doc()
    assert doc["role"] == "writer" and doc["workers"] == 2 and doc["uptime_s"] > 0 and isinstance(doc["pid"], int)
    disk = doc["disk"]
    assert disk["path"] == str(daemon.data_dir) and disk["measured"] == "filesystem"
    assert 0 < disk["used_bytes"] <= disk["capacity_bytes"] and disk["full"] is False
    assert doc["upload_backlog"] is None  # no object tier
    assert doc["fence"] == {"fenced": False} and doc["fleet"] is None
    assert doc["nixl"] == {"enabled": False} and "devices" in doc["rdma"] and doc["version"]
    human = admin(url, "status")
    assert human.code == 0, human.err
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in human.out.splitlines())
    assert set(lines) >= {"version", "uptime", "process", "disk", "upload backlog", "fence", "fleet", "nixl", "rdma"}
    assert lines["version"].startswith(doc["version"]) and lines["process"].endswith("2 workers")
    assert lines["upload backlog"] == "no object tier" and lines["fence"] == "not fenced"
    assert lines["fleet"] == "not in a fleet" and "GiB used of" in lines["disk"]
    # --wait off a fleet: there is nothing to wait for, and the change is answered as without it
    waited = admin(url, "tenants", "create", "nowait", "--wait", "--wait-timeout", "1")
    assert waited.code == 0 and waited.out.startswith("kvs_"), waited


def test_flush_compact_and_verify_and_damage_found(daemon: Daemon) -> None:
    url = daemon.base
    token = admin(url, "tenants", "create", "maint", "--policy", "direct").out.strip()
    data = os.urandom(3000)
    assert http(url, "PUT", "/v1/blocks/m", token, data) == 201
    flushed = admin(url, "flush")
    assert flushed.code == 0 and flushed.out.strip() == "flushed: every open segment sealed (no object tier)"
    assert admin(url, "flush", "--json", "--upload-timeout", "5").doc() == {"flushed": True, "tier": None}
    compacted = admin(url, "compact", "--tenant", "maint", "--json").doc()
    assert compacted["errors"] == [] and "segments_rewritten" in compacted
    human = admin(url, "compact")
    assert human.code == 0 and "errors" in human.out and "segments rewritten" in human.out
    failed(admin(url, "compact", "--tenant", "nobody"), 1, "404 tenant_not_found")
    clean = admin(url, "verify", "--deep")
    assert clean.code == 0 and clean.out.splitlines()[0].split() == ["result", "ok"], clean
    # A byte of the stored block flipped on disk (fault injection): verify says so, with exit status 5.
    seg = next((daemon.data_dir / "segments" / "maint").glob("*.seg"))
    raw = seg.read_bytes()
    at = raw.index(data[:64]) + 100
    with seg.open("r+b") as f:
        f.seek(at)
        f.write(bytes([raw[at] ^ 0xFF]))
    damaged = admin(url, "verify")
    failed(damaged, 5, "verify found damage", seg.name)
    assert damaged.out.startswith("result") and "DAMAGE FOUND" in damaged.out and "SEGMENT" in damaged.out
    report = admin(url, "verify", "--json")
    assert report.code == 5 and json.loads(report.out)["ok"] is False
    assert admin(url, "tenants", "delete", "maint").code == 0  # (the damaged tenant gone: later scrubs are clean)


def test_failures_are_one_line_with_their_exit_status(daemon: Daemon, tmp_path: Path) -> None:
    url = daemon.base
    failed(admin(url, "status", token="not-the-admin-token"), 1, "admin token was refused", url, "401")
    dead = f"http://127.0.0.1:{free_port()}"
    failed(admin(dead, "tenants", "list"), 3, "cannot reach the daemon", dead, "connection refused")
    failed(admin(url, "tenants", "show", "nobody"), 1, "404 tenant_not_found", "nobody")
    failed(admin(url, "tenants", "delete", "nobody"), 1, "404 tenant_not_found")
    # a bad value: refused by the command (nothing sent), or by the daemon (its code and message)
    failed(admin(url, "tenants", "patch", "nobody", "--quota", "-5"), 2, "--quota", "'-5'", "10GiB")
    failed(admin(url, "tenants", "patch", "nobody", "--ttl", "soon"), 2, "--ttl", "'soon'")
    assert admin(url, "tenants", "create", "bad").code == 0
    failed(admin(url, "tenants", "patch", "bad", "--admit-after", "99"), 1, "400 invalid_input", "admit_after")
    failed(admin(url, "tenants", "patch", "bad", "--eviction", "lfu"), 1, "400 invalid_input", "'eviction'", "lru")
    failed(admin(url, "tenants", "patch", "bad", "--weight", "0"), 1, "400 invalid_input", "qos.weight")
    failed(admin(url, "tenants", "patch", "bad"), 2, "nothing to change")
    failed(admin(url, "tenants", "create", "bad"), 1, "409 tenant_exists")
    failed(admin(url, "tenants", "create", "bad", "--policy", "plain"), 2, "--policy", "plain")
    failed(admin(url, "tenants"), 2, "ACTION", "kvstore admin tenants --help")
    failed(admin(url, "status", "--bogus"), 2, "--bogus")
    failed(admin(url, "status", token=None), 2, "no admin token", "KVSTORE_ADMIN_TOKEN")
    failed(admin("ftp://127.0.0.1:1", "status"), 2, "ftp://127.0.0.1:1")
    failed(admin(url, "status", "--token-file", str(tmp_path / "missing")), 2, "--token-file", "cannot read")

    # --url and --token(-file) before or after the command beat the environment
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN + "\n")
    by_flags = admin(dead, "--url", url, "status", "--token-file", str(token_file), "--json", token="wrong")
    assert by_flags.doc()["role"] == "writer"
    by_file_variable = admin(url, "status", "--json", token=None, KVSTORE_ADMIN_TOKEN_FILE=str(token_file))
    assert by_file_variable.doc()["workers"] == 2
    help_text = admin(url, "--help", token=None)
    assert help_text.code == 0 and "exit status:" in help_text.out and "`" not in help_text.out
    for command in (["tenants", "create"], ["tenants", "patch"], ["status"], ["verify"]):
        text = admin(url, *command, "--help", token=None)
        assert text.code == 0 and "exit status:" in text.out and "`" not in text.out, command
        assert "kvstore.admin" not in text.out and ".py" not in text.out, command


def test_the_list_counts_what_is_stored_and_deleted_at_once(daemon: Daemon) -> None:
    """The list's usage of a tenant is what the index counts for it (one
    read, no scan): blocks stored, then some deleted, show at once."""
    url = daemon.base
    token = admin(url, "tenants", "create", "counted", "--policy", "direct").out.strip()
    for i in range(20):
        assert http(url, "PUT", f"/v1/blocks/b{i}", token, bytes([i]) * 1000) == 201
    for i in range(5):
        assert http(url, "DELETE", f"/v1/blocks/b{i}", token) == 204
    got = next(t for t in admin(url, "tenants", "list", "--json").doc()["tenants"] if t["name"] == "counted")
    assert got["blocks"] == 15 and got["bytes_logical"] == 15_000
