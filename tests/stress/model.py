"""The model a stress run is checked against, and the content of every block.

Every block's bytes are a function of (tenant, incarnation, key) alone, so any
200 can be checked on the spot: a wrong byte, a block of another tenant or of
a deleted incarnation, or a stale block under a reused key all fail it.

Each client owns its keys (nobody else writes or deletes them) and runs one
operation at a time, so each key's history is sequential; what runs
concurrently with it (restarts, index deletion, eviction, compaction, S3
outages, tenant deletion) is what may legally make a block vanish, and only
for the tenants whose class allows it:

- ``strict`` tenants (persistent, no quota, no TTL): an acknowledged block
  reads back until the client deletes it. Nothing else may remove it.
- ``lenient`` tenants (ephemeral, over a quota, with a TTL): an acknowledged
  block may become a miss (evicted, expired), but never reads back wrong.

For every tenant: an acknowledged delete stays deleted (never a 200 again
until the client writes the key again), a block seen missing (removed for
its quota, its TTL or disk pressure) stays missing, across restarts and
index rebuilds, and a block of a deleted tenant is never served to its next
incarnation.
"""

from __future__ import annotations

import enum
import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

KV_DIR = Path(__file__).resolve().parents[2] / "bench" / "data" / "kv"


class State(enum.Enum):
    ABSENT = "absent"  # never acknowledged, or its delete was
    PRESENT = "present"  # its put was acknowledged, no delete since
    MAYBE = "maybe"  # an operation on it ended without a definite answer


@cache
def _samples() -> tuple[bytes, ...]:
    return tuple(p.read_bytes() for p in sorted(KV_DIR.glob("*.bin")))


@cache
def content(tenant: str, incarnation: int, key: str) -> bytes:
    """1 B to 300 KiB: real KV-cache bytes (compressible) or random ones."""
    rng = random.Random(hashlib.sha256(f"{tenant}/{incarnation}/{key}".encode()).digest())
    r = rng.random()
    size = (
        rng.randint(1, 16 << 10)
        if r < 0.7
        else rng.randint(16 << 10, 100 << 10)
        if r < 0.95
        else rng.randint(100 << 10, 300 << 10)
    )
    stamp = f"{tenant}/{incarnation}/{key}|".encode()  # whose block it is, in its first bytes
    samples = _samples()
    if samples and rng.random() < 0.5:
        s = samples[rng.randrange(len(samples))]
        start = rng.randrange(len(s) - size)
        body = s[start : start + size]
    else:
        body = rng.randbytes(size)
    return (stamp + body)[:size] if size > len(stamp) else body


@dataclass
class Violation:
    what: str
    tenant: str
    key: str
    detail: str

    def __str__(self) -> str:
        return f"{self.what}: {self.tenant}/{self.key}: {self.detail}"


@dataclass
class KeyModel:
    state: State = State.ABSENT
    incarnation: int = 0
    seen: float = field(default_factory=time.monotonic)  # when its client last wrote or read it


@dataclass
class Model:
    """The expected state of every key, per tenant, and what went wrong."""

    strict: set[str]
    # Tenants whose misses settle only after a while: a TTL's read-time
    # expiry is decided by each worker from the accesses it knows, which
    # reach the others within seconds; a miss is final once the block has
    # not been touched for this long (its TTL and that propagation).
    settle_s: dict[str, float] = field(default_factory=dict)
    keys: dict[tuple[str, str], KeyModel] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    history: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def note(self, tenant: str, key: str, what: str) -> None:
        """One line of a key's history (printed with a violation of it)."""
        self.history.setdefault((tenant, key), []).append(f"{time.monotonic() - self.t0:7.3f}s {what}")

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def get(self, tenant: str, key: str) -> KeyModel:
        return self.keys.setdefault((tenant, key), KeyModel())

    on_fail: Callable[[str, str], str] | None = None  # extra evidence, gathered the moment a check fails

    def fail(self, what: str, tenant: str, key: str, detail: str) -> None:
        if self.on_fail is not None:
            detail += f" [evidence: {self.on_fail(tenant, key)}]"
        self.note(tenant, key, f"VIOLATION {what}")
        past = "; ".join(self.history.get((tenant, key), [])[-8:])
        self.violations.append(Violation(what, tenant, key, f"{detail} [history: {past}]"))

    def effective(self, tenant: str, inc: int, key: str) -> State:
        """The key's state as the incarnation ``inc`` of its tenant sees it:
        whatever an earlier incarnation held is gone."""
        m = self.get(tenant, key)
        return m.state if m.incarnation == inc else State.ABSENT

    # -- what an answer teaches ---------------------------------------------------

    def put_acked(self, tenant: str, inc: int, key: str) -> None:
        self.note(tenant, key, f"put acked (incarnation {inc})")
        self.keys[(tenant, key)] = KeyModel(State.PRESENT, inc)

    def unknown(self, tenant: str, inc: int, key: str) -> None:
        self.note(tenant, key, f"outcome unknown (incarnation {inc})")
        self.keys[(tenant, key)] = KeyModel(State.MAYBE, inc)

    def deleted(self, tenant: str, inc: int, key: str) -> None:
        self.note(tenant, key, f"delete acked (incarnation {inc})")
        self.keys[(tenant, key)] = KeyModel(State.ABSENT, inc)

    def delete_missed_at(self, tenant: str, inc: int, key: str, may_miss: bool = False) -> None:
        """A delete answered 404. For a strict tenant the block is gone (if it
        was acknowledged, that is a loss). For a lenient one it was evicted or
        expired, which is as durable as a delete: it never comes back."""
        if self.effective(tenant, inc, key) is State.PRESENT and tenant in self.strict and not may_miss:
            self.fail("acknowledged block lost", tenant, key, "delete found nothing")
        self.keys[(tenant, key)] = KeyModel(State.ABSENT, inc)

    def _removed(self, tenant: str, inc: int, key: str, may_miss: bool) -> None:
        """A lenient tenant's acknowledged block found missing: it was removed
        (quota, TTL, disk pressure), and must stay so."""
        if tenant not in self.strict and not may_miss and self.effective(tenant, inc, key) is State.PRESENT:
            if time.monotonic() - self.get(tenant, key).seen < self.settle_s.get(tenant, 0.0):
                return  # an expiry one worker sees before another has heard of the last read
            self.note(tenant, key, f"seen removed (incarnation {inc})")
            self.keys[(tenant, key)] = KeyModel(State.ABSENT, inc)

    # -- checks -----------------------------------------------------------------------

    def check_read(
        self,
        tenant: str,
        inc: int,
        key: str,
        status: int,
        body: bytes | None,
        rng: tuple[int, int] | None = None,
        may_miss: bool = False,
    ) -> None:
        """A GET (``rng``: the byte range asked for, as [start, end)), or one
        item of a batch get. ``may_miss``: the tenant was being deleted
        meanwhile, so a miss says nothing."""
        state = self.effective(tenant, inc, key)
        self.note(tenant, key, f"read {status} (incarnation {inc})")
        if status in (200, 206):
            want = content(tenant, inc, key)
            if rng is not None:
                want = want[rng[0] : rng[1]]
            if body != want:
                self.fail("wrong bytes", tenant, key, f"{len(body or b'')} bytes, expected {len(want)}")
            elif state is State.ABSENT:
                self.fail("deleted, removed (or never written) block read back", tenant, key, f"incarnation {inc}")
            self.get(tenant, key).seen = time.monotonic()
            self.count("hit")
        elif status == 404:
            if state is State.PRESENT and tenant in self.strict and not may_miss:
                self.fail("acknowledged block lost", tenant, key, "404")
            self._removed(tenant, inc, key, may_miss)
            self.count("miss")

    def check_present_at(self, tenant: str, inc: int, key: str, present: bool, may_miss: bool = False) -> None:
        """A lookup's or HEAD's answer."""
        state = self.effective(tenant, inc, key)
        if present and state is State.ABSENT:
            self.fail("deleted block reported present", tenant, key, "lookup/head")
        if not present and state is State.PRESENT and tenant in self.strict and not may_miss:
            self.fail("acknowledged block reported absent", tenant, key, "lookup/head")
        if not present:
            self._removed(tenant, inc, key, may_miss)
