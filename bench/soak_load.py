"""kvstore-bench soak's workload: tenants, blocks whose bytes follow from their
keys, client loops that check every byte they read, and the operator's churn.

Every block's bytes are derived from (seed, tenant, index) (:func:`payload`),
so a read is checked against what was stored under its key without keeping
the blocks: a block returned with other bytes is a wrong block, and its
differing bytes are counted (``wrong_bytes``). Misses are told apart:

* a tenant that drops nothing (no quota, no TTL: ``keep``) keeps a sliding
  window of its latest ``window`` blocks (older ones are deleted, oldest
  first, by the loop that wrote past the window). A miss of a block it
  acknowledged and never deleted is a **lost** block, an error; a deleted
  block read back is **resurrected**, an error too;
* a tenant with a quota or a TTL (``evicting``) may lose any block to its
  quota, its TTL or a random delete: a miss there is only a miss.

Errors (:class:`Tally`): any 5xx, any 4xx (none is expected: a miss is a
404, which the client turns into None), any other client exception, a wrong
block, a lost or resurrected block, an operator call not answered as
expected. Latencies are the client call's alone (the check is not timed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

MIN_BLOCK = 4 << 10
MAX_BLOCK = 1 << 20
OPS = ("put", "get", "lookup", "delete", "put_many", "get_many")
# The operation mix (weights): a cache's day is mostly reads, some writes; deletes go to the
# evicting tenants (the keeping ones delete as their window slides, after their puts).
OP_WEIGHTS = {"put": 25, "get": 45, "lookup": 10, "delete": 5, "put_many": 5, "get_many": 10}
BATCH = 4  # blocks per put_many / get_many
CHAIN = 8  # keys per lookup
RECENT = 64  # an evicting tenant's reads pick among its latest RECENT blocks
KEPT_DELETED = 512  # deleted blocks remembered per keeping tenant, to read back as misses
MAX_MESSAGES = 20  # error messages kept for the report


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant of the soak: ``fields`` as POST /v1/admin/tenants takes them;
    ``keep``: it drops nothing (its misses of acknowledged blocks are errors)."""

    name: str
    label: str  # the keys' prefix
    policy: str
    keep: bool
    fields: dict[str, Any] = field(default_factory=dict)


QUOTA_HIGH, QUOTA_LOW = 32 << 20, 8 << 20  # the quota tenant's churn: down to LOW, back up to HIGH
TTL_LONG, TTL_SHORT = 45, 20  # the TTL tenant's churn, seconds


def tenant_specs(prefix: str) -> list[TenantSpec]:
    """The soak's tenants, names prefixed with ``prefix``: sealed and direct
    ones that drop nothing, a direct one whose quota evicts, a sealed one
    whose blocks expire."""
    return [
        TenantSpec(f"{prefix}sealed", "s", "sealed", keep=True),
        TenantSpec(f"{prefix}direct", "d", "direct", keep=True),
        TenantSpec(f"{prefix}quota", "q", "direct", keep=False, fields={"quota_bytes": QUOTA_HIGH}),
        TenantSpec(f"{prefix}ttl", "t", "sealed", keep=False, fields={"ttl_s": TTL_LONG}),
    ]


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


# -- blocks -------------------------------------------------------------------------------


def block_seed(seed: int, tenant: str, n: int) -> int:
    """64 bits that the block ``n`` of ``tenant`` is derived from."""
    digest = hashlib.blake2b(f"{seed}/{tenant}/{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_size(bits: int) -> int:
    """A size from MIN_BLOCK to MAX_BLOCK, log-uniform (as many blocks of 4-8
    KiB as of 512 KiB-1 MiB), any byte count: not only page multiples."""
    u = (bits >> 11) / float(1 << 53)  # [0, 1)
    return min(MAX_BLOCK, round(MIN_BLOCK * math.exp(u * math.log(MAX_BLOCK / MIN_BLOCK))))


def payload(seed: int, tenant: str, n: int) -> bytes:
    """The bytes of block ``n`` of ``tenant``: 6 random bits a byte (zstd
    saves about a quarter, as it roughly does on KV caches), from its seed."""
    bits = block_seed(seed, tenant, n)
    rng = np.random.default_rng(bits)
    return rng.integers(0, 64, block_size(bits), dtype=np.uint8).tobytes()


def wrong_bytes(got: bytes, want: bytes) -> int:
    """Bytes of ``got`` that differ from ``want``, a difference in length counted whole."""
    if got == want:
        return 0
    m = min(len(got), len(want))
    a = np.frombuffer(got, dtype=np.uint8, count=m)
    b = np.frombuffer(want, dtype=np.uint8, count=m)
    return int(np.count_nonzero(a != b)) + abs(len(got) - len(want))


# -- what each tenant holds -------------------------------------------------------------------


@dataclass
class Keys:
    """A tenant's blocks as the clients know them: indexes below ``next`` were
    put (or are being put); below ``low`` deleted or being deleted (a keeping
    tenant's window). Bounded: the sets hold what is in flight or failed."""

    spec: TenantSpec
    window: int
    next: int = 0
    low: int = 0
    writing: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    deleted: deque[int] = field(default_factory=lambda: deque(maxlen=KEPT_DELETED))

    def key(self, n: int) -> str:
        return f"{self.spec.label}-{n:09d}"

    def claim(self, count: int) -> list[int]:
        """``count`` new indexes to write."""
        ns = list(range(self.next, self.next + count))
        self.next += count
        self.writing.update(ns)
        return ns

    def written(self, n: int, ok: bool) -> None:
        self.writing.discard(n)
        if not ok:
            self.failed.add(n)

    def stored(self, n: int) -> bool:
        """Whether ``n`` must be there now: acknowledged, and (keeping tenant) not deleted."""
        return self.spec.keep and self.low <= n < self.next and n not in self.writing and n not in self.failed

    def pick(self, rng: random.Random) -> int | None:
        """An index to read: in a keeping tenant's window, or among an evicting one's latest."""
        start = self.low if self.spec.keep else max(0, self.next - RECENT)
        return rng.randrange(start, self.next) if self.next > start else None

    def trim(self) -> list[int]:
        """A keeping tenant's indexes that slid out of its window: marked deleted
        (``low`` moves first, so no read counts them as lost from now on)."""
        if not self.spec.keep:
            return []
        out = []
        while self.next - self.low > self.window:
            out.append(self.low)
            self.low += 1
        return out


# -- the tally -------------------------------------------------------------------------------


@dataclass
class Tally:
    """Operations, their latencies (over the current sampling interval) and errors."""

    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("http_5xx", "http_4xx", "exceptions", "wrong_blocks", "lost", "resurrected", "operator"), 0
        )
    )
    wrong_bytes: int = 0
    hits: int = 0
    misses: int = 0
    messages: list[str] = field(default_factory=list)

    def error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        if len(self.messages) < MAX_MESSAGES:
            self.messages.append(f"{kind}: {message}")

    def failure(self, op: str, e: BaseException) -> None:
        """A client call's exception, by kind (its status when the server answered one)."""
        status = getattr(e, "status", None)
        if isinstance(status, int) and status >= 500:
            self.error("http_5xx", f"{op}: {e}")
        elif isinstance(status, int) and status >= 400:
            self.error("http_4xx", f"{op}: {e}")
        else:
            self.error("exceptions", f"{op}: {type(e).__name__}: {e}")

    def interval(self) -> dict[str, list[float]]:
        """The latencies since the last call (seconds), and a fresh start."""
        out, self.latencies = self.latencies, {op: [] for op in OPS}
        return out

    @property
    def total_errors(self) -> int:
        return sum(self.errors.values())


# -- the clients' loops -----------------------------------------------------------------------


class Workload:
    """The clients' operations over the tenants, each client a loop paced to
    its share of ``rate`` operations a second. ``clients`` maps each tenant's
    name to its AsyncClient (strict: failures raise)."""

    def __init__(self, keys: list[Keys], clients: dict[str, Any], seed: int, tally: Tally) -> None:
        self.keys = keys
        self.clients = clients
        self.seed = seed
        self.tally = tally
        self.evicting = [k for k in keys if not k.spec.keep]

    async def run(self, index: int, rate: float, stop: asyncio.Event) -> None:
        """Client ``index``'s loop until ``stop``; ``rate``: its operations a second."""
        rng = random.Random(self.seed * 1_000_003 + index)
        ops, weights = list(OP_WEIGHTS), list(OP_WEIGHTS.values())
        interval, due = 1.0 / rate, time.monotonic()
        while not stop.is_set():
            op = rng.choices(ops, weights)[0]
            keys = rng.choice(self.evicting if op == "delete" and self.evicting else self.keys)
            await getattr(self, op)(keys, rng)
            due = max(due + interval, time.monotonic() - 1.0)  # a stall is not made up in a burst
            await pause(stop, due - time.monotonic())

    async def _call(self, op: str, call: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
        """(True, the result) of a client call, timed; (False, None) when it raised (tallied)."""
        t0 = time.perf_counter()
        try:
            result = await call()
        except Exception as e:  # noqa: BLE001 - every failure is tallied by kind, the loop goes on
            self.tally.failure(op, e)
            return False, None
        self.tally.latencies[op].append(time.perf_counter() - t0)
        self.tally.done[op] += 1
        return True, result

    def _payload(self, keys: Keys, n: int) -> bytes:
        return payload(self.seed, keys.spec.name, n)

    # operations

    async def put(self, keys: Keys, rng: random.Random) -> None:
        (n,) = keys.claim(1)
        client = self.clients[keys.spec.name]
        data = self._payload(keys, n)
        ok, stored = await self._call("put", partial(client.put, keys.key(n), data))
        if ok and not stored:
            self.tally.error("http_4xx", f"put {keys.key(n)}: not stored (not admitted)")
        keys.written(n, bool(ok and stored))
        await self._slide(keys)

    async def put_many(self, keys: Keys, rng: random.Random) -> None:
        ns = keys.claim(BATCH)
        client = self.clients[keys.spec.name]
        items = [(keys.key(n), self._payload(keys, n)) for n in ns]
        ok, stored = await self._call("put_many", partial(client.put_many, items))
        for i, n in enumerate(ns):
            done = bool(ok and stored[i])
            if ok and not done:
                self.tally.error("http_4xx", f"put_many {keys.key(n)}: not stored")
            keys.written(n, done)
        await self._slide(keys)

    async def _slide(self, keys: Keys) -> None:
        """A keeping tenant's blocks that left its window, deleted (each a delete
        operation); one it acknowledged must be there to delete."""
        client = self.clients[keys.spec.name]
        for n in keys.trim():
            owed = n not in keys.writing and n not in keys.failed
            ok, had = await self._call("delete", partial(client.delete, keys.key(n)))
            if ok:
                keys.deleted.append(n)
                if owed and not had:
                    self.tally.error("lost", f"{keys.spec.name} {keys.key(n)}: acknowledged, not there to delete")

    async def delete(self, keys: Keys, rng: random.Random) -> None:
        n = keys.pick(rng)
        if n is not None:
            client = self.clients[keys.spec.name]
            await self._call("delete", partial(client.delete, keys.key(n)))

    async def get(self, keys: Keys, rng: random.Random) -> None:
        if keys.deleted and rng.random() < 0.05:  # now and then, a block deleted earlier: must miss
            gone = rng.choice(keys.deleted)
            ok, data = await self._call("get", partial(self.clients[keys.spec.name].get, keys.key(gone)))
            if ok and data is not None:
                self.tally.error("resurrected", f"{keys.spec.name} {keys.key(gone)}: read back after its delete")
            return
        n = keys.pick(rng)
        if n is None:
            return
        must = keys.stored(n)
        ok, data = await self._call("get", partial(self.clients[keys.spec.name].get, keys.key(n)))
        if ok:
            self._check(keys, n, data, must)

    async def get_many(self, keys: Keys, rng: random.Random) -> None:
        picks = [n for n in (keys.pick(rng) for _ in range(BATCH)) if n is not None]
        if not picks:
            return
        picks = list(dict.fromkeys(picks))
        must = [keys.stored(n) for n in picks]
        client = self.clients[keys.spec.name]
        ok, blocks = await self._call("get_many", partial(client.get_many, [keys.key(n) for n in picks]))
        if ok:
            for n, data, m in zip(picks, blocks, must, strict=True):
                self._check(keys, n, data, m)

    def _check(self, keys: Keys, n: int, data: bytes | None, must: bool) -> None:
        """A read of block ``n``: its bytes checked; a miss an error only if the
        block had to be there when the read began and was not deleted since."""
        if data is None:
            self.tally.misses += 1
            if must and n >= keys.low:
                self.tally.error("lost", f"{keys.spec.name} {keys.key(n)}: acknowledged, never deleted, missing")
            return
        self.tally.hits += 1
        wrong = wrong_bytes(data, self._payload(keys, n))
        if wrong:
            self.tally.wrong_bytes += wrong
            self.tally.error("wrong_blocks", f"{keys.spec.name} {keys.key(n)}: {wrong} of {len(data)} bytes wrong")

    async def lookup(self, keys: Keys, rng: random.Random) -> None:
        """A chain of CHAIN consecutive blocks looked up; in a keeping tenant a
        chain whose blocks were all stored must be found whole."""
        start = keys.pick(rng)
        if start is None:
            return
        ns = list(range(start, start + CHAIN))
        must = all(keys.stored(n) for n in ns)
        client = self.clients[keys.spec.name]
        ok, found = await self._call("lookup", partial(client.lookup, [keys.key(n) for n in ns]))
        if ok and must and found < CHAIN and start >= keys.low:
            self.tally.error("lost", f"{keys.spec.name} lookup from {keys.key(start)}: {found} of {CHAIN} found")


# -- the operator --------------------------------------------------------------------------


@dataclass
class Operator:
    """What an operator does to the daemon meanwhile, each on its own period:
    ``churn_s``, a quota down or up and a TTL changed; ``maintenance_s``, a
    flush and a compaction; ``sighup_s``, a SIGHUP to the supervisor (and
    the daemon must go on answering). Each happens first during the warm-up
    (so that what it allocates once is there before the bounds are taken),
    then every period. ``admin(method, path, doc)`` answers (status, JSON);
    ``hangup()`` sends the signal (None: no process to signal)."""

    admin: Callable[[str, str, dict[str, Any] | None], Awaitable[tuple[int, Any]]]
    hangup: Callable[[], Awaitable[float | None]] | None
    tally: Tally
    quota_tenant: str
    ttl_tenant: str
    churn_s: float
    maintenance_s: float
    sighup_s: float
    events: list[dict[str, Any]] = field(default_factory=list)
    _churns: int = 0

    async def run(self, warmup_s: float, started: float, stop: asyncio.Event) -> None:
        jobs = [
            (self.churn, self.churn_s, 0.3),
            (self.maintenance, self.maintenance_s, 0.5),
            (self.sighup, self.sighup_s, 0.7),
        ]
        due = [started + warmup_s * first for _, _, first in jobs]
        while not stop.is_set():
            now = time.monotonic()
            for i, (job, period, _) in enumerate(jobs):
                if now >= due[i] and period > 0:
                    due[i] = now + period
                    await job(now - started)
            await pause(stop, 0.5)

    async def _expect(self, t: float, what: str, method: str, path: str, doc: dict[str, Any] | None) -> Any:
        """An admin call that must answer 200; its JSON, or None (tallied) if not."""
        t0 = time.monotonic()
        try:
            status, body = await self.admin(method, path, doc)
        except Exception as e:  # noqa: BLE001 - tallied; the soak goes on
            self.tally.error("operator", f"{what}: {type(e).__name__}: {e}")
            self.events.append({"t": round(t, 1), "what": what, "ok": False})
            return None
        ok = status == 200
        if not ok:
            self.tally.error("operator", f"{what}: HTTP {status}: {str(body)[:300]}")
        self.events.append({"t": round(t, 1), "what": what, "ok": ok, "s": round(time.monotonic() - t0, 3)})
        return body if ok else None

    async def churn(self, t: float) -> None:
        down = self._churns % 2 == 0
        self._churns += 1
        quota = QUOTA_LOW if down else QUOTA_HIGH
        ttl = TTL_SHORT if down else TTL_LONG
        tenants = "/v1/admin/tenants/"
        await self._expect(t, f"quota {quota >> 20} MiB", "PATCH", tenants + self.quota_tenant, {"quota_bytes": quota})
        await self._expect(t, f"ttl {ttl} s", "PATCH", tenants + self.ttl_tenant, {"ttl_s": ttl})

    async def maintenance(self, t: float) -> None:
        await self._expect(t, "flush", "POST", "/v1/admin/flush?timeout_s=120", None)
        report = await self._expect(t, "compact", "POST", "/v1/admin/compact", None)
        if isinstance(report, dict) and report.get("errors"):
            self.tally.error("operator", f"compaction errors: {report['errors']}")

    async def sighup(self, t: float) -> None:
        if self.hangup is None:
            return
        try:
            ready_s = await self.hangup()
        except OSError as e:
            self.tally.error("operator", f"SIGHUP: {e}")
            ready_s = None
        if ready_s is None:
            self.tally.error("operator", "after SIGHUP the daemon did not answer /readyz with 200")
        self.events.append({"t": round(t, 1), "what": "SIGHUP", "ok": ready_s is not None, "s": ready_s})
