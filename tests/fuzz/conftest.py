"""The fuzz suite: bounded by default (CI), as long as you like on demand.

    .venv/bin/python -m pytest -q tests/fuzz                          # bounded, derandomized
    KVSTORE_FUZZ_SECONDS=600 .venv/bin/python -m pytest -q tests/fuzz # each fuzz test: random rounds for 600 s
    KVSTORE_FUZZ_SEED=N .venv/bin/python -m pytest -q tests/fuzz -k … # replay one round

Bounded runs are derandomized (the same examples every run, so CI is
repeatable); long runs draw a fresh seed per round and print it (pytest shows
it with a failure; KVSTORE_FUZZ_SEED replays that round).

The daemon fixtures start ``server.py`` (one worker, then ``--workers 2``)
with two tenants and canary blocks cut from real KV caches. After each fuzz
test, :meth:`Target.check` asserts what must hold whatever was sent: every
worker answers, every canary reads back byte-identical through every worker,
no tenant sees another's blocks, no token or key material is in the log, no
traceback or ERROR line either, and the processes' memory stayed bounded.
"""

from __future__ import annotations

import base64
import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.strategies import SearchStrategy

from tests.conftest import kv_sample
from tests.fuzz.client import Worker
from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port

FUZZ_SECONDS = float(os.environ.get("KVSTORE_FUZZ_SECONDS") or 0)
FUZZ_SEED = int(os.environ["KVSTORE_FUZZ_SEED"]) if os.environ.get("KVSTORE_FUZZ_SEED") else None
# RSS growth allowed over a fuzz test, all daemon processes together: generous
# (allocator arenas, caches), but far below what an unbounded buffer would take.
RSS_GROWTH_LIMIT = 384 << 20


def fuzz(body: Callable[..., None], examples: int, **strategies: SearchStrategy[Any]) -> None:
    """Run ``body`` on examples drawn from ``strategies``: ``examples`` of
    them, derandomized (by default), or random rounds of ``examples`` each
    until KVSTORE_FUZZ_SECONDS have passed, or the round KVSTORE_FUZZ_SEED."""
    base = settings(
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    if FUZZ_SEED is not None:
        seed(FUZZ_SEED)(settings(base, max_examples=examples)(given(**strategies)(body)))()
        return
    if FUZZ_SECONDS <= 0:
        settings(base, max_examples=examples, derandomize=True)(given(**strategies)(body))()
        return
    end = time.monotonic() + FUZZ_SECONDS
    round_no = 0
    while time.monotonic() < end:
        n = random.getrandbits(64)
        print(f"fuzz round {round_no} of {body.__qualname__}: KVSTORE_FUZZ_SEED={n}", flush=True)
        seed(n)(settings(base, max_examples=examples)(given(**strategies)(body)))()
        round_no += 1


@dataclass
class Target:
    """A running daemon under fuzzing, and what must stay true about it."""

    daemon: Daemon
    roles: list[str]
    tokens: dict[str, str]
    canaries: dict[str, dict[str, bytes]]
    secrets: list[str]
    workers: dict[str, Worker] = field(default_factory=dict)
    rss_start: int = 0

    @property
    def port(self) -> int:
        return self.daemon.port

    def worker(self, role: str) -> Worker:
        if role not in self.workers:
            self.workers[role] = Worker(self.port, role)
        return self.workers[role]

    def pids(self) -> list[int]:
        assert self.daemon.proc is not None
        pid = self.daemon.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [pid, *map(int, children)]

    def rss(self) -> int:
        total = 0
        for pid in self.pids():
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total

    def check(self) -> None:
        """Everything that must hold after any input."""
        for role in self.roles:
            w = self.worker(role)
            assert w.request("GET", "/healthz").status == 200, role
            for tenant, blocks in self.canaries.items():
                auth = {"Authorization": f"Bearer {self.tokens[tenant]}"}
                for key, data in blocks.items():
                    r = w.request("GET", f"/v1/blocks/{key}", auth)
                    assert r.status == 200 and r.body == data, (role, tenant, key, r.status, r.body[:200])
                # No tenant sees another's blocks: under another tenant's canary key a
                # tenant finds nothing, or a block it stored itself (the fuzzer may
                # have put one), never the other tenant's bytes.
                for other, theirs in self.canaries.items():
                    for key, data in theirs.items() if other != tenant else ():
                        r = w.request("GET", f"/v1/blocks/{key}", auth)
                        assert r.status in (200, 404) and r.body != data, (role, tenant, key, r.status)
                r = w.request("GET", "/v1/stats", auth)
                assert r.status == 200 and json.loads(r.body)["tenant"] == tenant, (role, r.body)
            metrics = w.request("GET", "/metrics").body.decode()
            assert 'kvstore_errors_total{code="internal"}' not in metrics, role
        log = self.daemon.log.read_text(errors="replace")
        for secret in self.secrets:
            assert secret not in log, "a secret reached the log"
        assert "Traceback" not in log and " ERROR " not in log, log[-4000:]
        grown = self.rss() - self.rss_start
        assert grown < RSS_GROWTH_LIMIT, f"daemon RSS grew by {grown >> 20} MiB"


CANARY_SOURCES = {
    "canary-a": [
        ("gemma3-270m.bf16.layers8-9.bin", 1_000_003, 100),
        ("minilm-l6-v2.bf16.first2MiB.bin", 4096, 1 << 20),
    ],
    "canary-b": [("gemma3-270m.f16.layer8.bin", 77, 300_000), ("minilm-l6-v2.f16.first2MiB.bin", 0, 2 << 20)],
}
SETTINGS = {
    "segment_size": "1MiB",
    "frame_size": "64KiB",
    "max_block_size": "4MiB",
    "max_lookup_keys": "256",
    "max_batch_keys": "64",
    "max_buffered_body_bytes": "64MiB",
    "request_timeout_s": "2",
    "keepalive_timeout_s": "5",
    "log_level": "debug",  # the log check covers debug lines too
}


def start_target(tmp: Path, workers: int) -> Target:
    env = daemon_env(tmp, **SETTINGS)
    daemon = Daemon(tmp / "data", free_port(), env)
    if workers > 1:
        daemon.extra = ["--workers", str(workers)]
    daemon.start()
    roles = ["single"] if workers == 1 else ["writer", "reader"]
    key = Path(env["KVSTORE_MASTER_KEY_FILE"]).read_bytes()
    target = Target(daemon, roles, {}, {}, [ADMIN, key.hex(), base64.b64encode(key).decode()])
    first = target.worker(roles[0])
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for tenant, sources in CANARY_SOURCES.items():
        policy = "sealed" if tenant == "canary-a" else "direct"
        r = first.request("POST", "/v1/admin/tenants", admin, json.dumps({"name": tenant, "policy": policy}).encode())
        assert r.status == 201, r.body
        target.tokens[tenant] = json.loads(r.body)["token"]
        target.secrets.append(target.tokens[tenant])
        blocks = target.canaries.setdefault(tenant, {})
        for i, (name, start, size) in enumerate(sources):
            key_name = f"canary.{tenant[-1]}{i}"
            blocks[key_name] = kv_sample(name)[start : start + size]
            auth = {"Authorization": f"Bearer {target.tokens[tenant]}"}
            assert first.request("PUT", f"/v1/blocks/{key_name}", auth, blocks[key_name]).status == 201
    target.check()
    target.rss_start = target.rss()
    return target


@pytest.fixture(scope="module", params=[1, 2], ids=["1-worker", "2-workers"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    t = start_target(tmp_path_factory.mktemp(f"fuzz{request.param}"), request.param)
    try:
        yield t
    finally:
        for w in t.workers.values():
            w.close()
        t.daemon.stop()
