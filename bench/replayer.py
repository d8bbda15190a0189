"""The replay of ``kvstore-bench replay`` (``replay.py``): requests of a trace through the client library.

Each request becomes what an engine with kvstore under it does: a prefix
lookup of its chain (``lookup`` with ``tokens_per_block``), a load of the
prefix found (``get_many_into``, at most :data:`LOAD_WINDOW_BYTES` a call,
every block compared with the bytes stored under it), and stores of the rest
(``put_many_detail``). Requests start at ``speed`` times the trace's pace
(0: as soon as one of ``concurrency`` slots is free), in the trace's order.
Block ``i`` of the trace is stored under ``bench-<run id>-<digest of i>``
(:func:`block_key`: a key in no order of the chain's, as an engine's content
hashes are; :class:`BlockBytes` says what it holds). Meanwhile the daemon's counters
that the client cannot see (``/metrics``: reads from the object tier, bytes
written) are sampled every :data:`METRICS_EVERY_S`.

Against a fleet (``fleet``: the endpoints are seeds, the client places each
key on its owner) what is read from the daemons covers every member, those
the client knows when the replay starts: their ``/metrics`` counters are
summed, and the blocks held are the run's keys listed on each member.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from kvstore_client import AsyncClient
from kvstore_client.answers import NOT_ADMITTED

from .models import ModelGeometry
from .run import Progress, Recorder, error_kind, held_keys, key_prefix, members
from .samples import SAMPLES, load_pool
from .sizing import kv_bytes_per_block
from .trace import Request

LOAD_WINDOW_BYTES = 64 << 20  # block bytes one get_many_into or put_many call moves, at most
MAX_BATCH_KEYS = 1024  # the client's and the daemon's default max_batch_keys
METRICS_EVERY_S = 1.0
SNAPSHOT_WAIT_S = 0.6  # workers snapshot their metrics every 0.5 s (docs/API.md)
STAMP = struct.Struct("<QQ")  # block id, run nonce: the first bytes of every block
TIER_READS = "kvstore_tier_reads_total"
BYTES_WRITTEN = "kvstore_bytes_written_total"


# -- options ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """What one replay does, checked (``replay.py`` builds it from the command line)."""

    trace: Path
    requests: int | None
    model: ModelGeometry
    tokens_per_block: int
    block_bytes: int
    speed: float  # 0: as fast as the slots allow
    concurrency: int
    endpoints: tuple[str, ...]  # --endpoint's URLs (a fleet's seeds); none: daemons started here
    fleet: bool  # the daemons are a fleet (the client reads its members; started here: ``nodes`` of them)
    nodes: int | None  # the fleet started here, its nodes
    token: str | None
    metrics_token: str | None
    keep: bool
    policy: str
    quota: int | None
    admit_after: int  # the started daemon's tenant's (1: every block stored at its first offer)
    settings: dict[str, str]
    prefill_tps: float | None
    timeout: float
    progress: bool
    json_path: Path | None
    png_path: Path | None
    compare: tuple[str, ...] = ()  # quota_eviction policies replayed one after the other (a started daemon)

    @property
    def existing(self) -> bool:
        """Against daemons already running (``--endpoint``), not started here."""
        return bool(self.endpoints)

    @property
    def model_block_bytes(self) -> int:
        """The KV cache of one trace block of the model (all layers, all heads)."""
        return kv_bytes_per_block(self.model, self.tokens_per_block)


# -- block bytes ------------------------------------------------------------------------


class BlockBytes:
    """The bytes of trace block ``i``: ``size`` bytes of the KV samples from an
    offset chosen by ``i`` (wrapping around), the first 16 stamped with ``i``
    and the run's nonce. Made again to check a load, never kept."""

    ALIGN = 4096

    def __init__(self, size: int, pool: bytes, nonce: int) -> None:
        self.size, self.nonce = size, nonce
        self._slots = max(1, len(pool) // self.ALIGN)
        self._tiled = pool * (size // len(pool) + 2)

    def of(self, block_id: int) -> bytearray:
        start = (block_id * 2654435761 % self._slots) * self.ALIGN  # Knuth's multiplicative spread
        out = bytearray(self._tiled[start : start + self.size])
        STAMP.pack_into(out, 0, block_id & (2**64 - 1), self.nonce)
        return out

    def wrong(self, block_id: int, got: memoryview) -> int:
        """Bytes of ``got`` that are not block ``block_id``'s (a length off counts its difference)."""
        want = self.of(block_id)
        if got == want:
            return 0
        common = min(len(got), len(want))
        a = np.frombuffer(got[:common], dtype=np.uint8)
        b = np.frombuffer(want, dtype=np.uint8, count=common)
        return int(np.count_nonzero(a != b)) + abs(len(got) - len(want))


# -- the replay ---------------------------------------------------------------------------


@dataclass(slots=True)
class Served:
    """What one request of the trace got from the daemon."""

    found: int = 0  # blocks the lookup found from the start of the chain
    loaded: int = 0  # of those, blocks loaded whole from the start: the hit
    stored: int = 0  # blocks this request stored anew
    stored_before: int = 0  # blocks it stored that were there already (a use, no write)
    declined: int = 0  # blocks it offered that the tenant's admission declined (202: not stored)
    lookup_s: float | None = None
    load_s: float | None = None
    store_s: float | None = None
    late_s: float | None = None  # how far behind the trace's schedule it started (--speed)
    end_s: float = 0.0  # when it ended, from the start of the replay
    wrong_bytes: int = 0
    error: str | None = None


class Replayer:
    """What a request of the trace does, through ``client``, with the bytes of ``blocks``
    (``serve``: each call one request; ``drive`` runs several at once)."""

    def __init__(self, client: AsyncClient, opts: ReplayOptions, blocks: BlockBytes, run_id: str) -> None:
        self.client, self.opts, self.blocks = client, opts, blocks
        self.prefix = key_prefix(run_id)
        self.window = max(1, min(MAX_BATCH_KEYS, LOAD_WINDOW_BYTES // blocks.size))

    def key(self, block_id: int) -> str:
        return block_key(self.prefix, block_id)

    async def serve(self, r: Request) -> Served:
        """Lookup, load of the prefix found, stores of the rest; a failure ends
        the request, counted by kind in ``error`` (what it did so far stands)."""
        s = Served()
        keys = [self.key(h) for h in r.hash_ids]
        if not keys:
            return s  # an empty prompt: nothing to look up
        try:
            t = time.perf_counter()
            s.found = await self.client.lookup(keys, self.opts.tokens_per_block)
            s.lookup_s = time.perf_counter() - t
            if s.found:
                t = time.perf_counter()
                s.loaded, s.wrong_bytes = await self._load(r.hash_ids[: s.found], keys[: s.found])
                s.load_s = time.perf_counter() - t
            if s.loaded < len(keys):
                t = time.perf_counter()
                s.stored, s.stored_before, s.declined = await self._store(r.hash_ids[s.loaded :], keys[s.loaded :])
                s.store_s = time.perf_counter() - t
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - counted by kind; the replay goes on
            s.error = error_kind(e)
        return s

    async def _load(self, ids: Sequence[int], keys: list[str]) -> tuple[int, int]:
        """(blocks loaded whole from the start, bytes that differed from the stored)."""
        loaded = wrong = 0
        for start in range(0, len(keys), self.window):
            part = range(start, min(len(keys), start + self.window))
            bufs = [bytearray(self.blocks.size) for _ in part]
            sizes = await self.client.get_many_into([keys[i] for i in part], bufs)
            for i, buf, size in zip(part, bufs, sizes, strict=True):
                if size is None:
                    return loaded, wrong
                wrong += self.blocks.wrong(ids[i], memoryview(buf)[:size])
                loaded += 1
        return loaded, wrong

    async def _store(self, ids: Sequence[int], keys: list[str]) -> tuple[int, int, int]:
        """(blocks stored anew, blocks that were there already, blocks the
        tenant's admission declined)."""
        new = before = declined = 0
        for start in range(0, len(keys), self.window):
            part = range(start, min(len(keys), start + self.window))
            items = [(keys[i], self.blocks.of(ids[i])) for i in part]
            statuses = await self.client.put_many_detail(items)
            new += statuses.count(201)
            before += statuses.count(200)
            declined += statuses.count(NOT_ADMITTED)
            if None in statuses:
                raise RuntimeError(f"{statuses.count(None)} of {len(items)} blocks not stored")
        return new, before, declined


async def drive(replayer: Replayer, requests: Sequence[Request], rec: Recorder) -> list[Served]:
    """Every request, started at its time (``--speed``, from ``rec.t0``) once a slot is free."""
    opts = replayer.opts
    out = [Served() for _ in requests]
    slots = asyncio.Semaphore(opts.concurrency)
    first = requests[0].timestamp_ms

    async def one(i: int, due: float | None) -> None:
        try:
            start = time.perf_counter()
            s = out[i] = await replayer.serve(requests[i])
            s.late_s = None if due is None else start - due
            s.end_s = time.perf_counter() - rec.t0
            if s.error is not None:
                rec.error(s.error)
            else:
                rec.ok("request", start, (s.loaded + s.stored) * replayer.blocks.size)
        finally:
            slots.release()

    async with asyncio.TaskGroup() as tg:
        for i, r in enumerate(requests):
            due = rec.t0 + (r.timestamp_ms - first) / 1e3 / opts.speed if opts.speed else None
            if due is not None:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await slots.acquire()
            tg.create_task(one(i, due))
    return out


@dataclass(frozen=True, slots=True)
class Sample:
    """The daemons' counters at ``t`` seconds into the replay (summed over a fleet's members)."""

    t: float
    tier_reads: float
    bytes_written: float
    # the daemons' own request-time histograms of DAEMON_ROUTES: route -> (le, count)
    buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


class Metrics:
    """The daemons' counters that the client cannot see (``/metrics`` of each
    of ``bases``: one daemon, or a fleet's members), sampled every
    :data:`METRICS_EVERY_S` over the replay, summed over ``bases``. A sample
    with a member missing would be a wrong sum, so it is dropped, and
    ``failure`` says why (a metrics token the daemon wants and was not
    given, say)."""

    def __init__(self, bases: Sequence[str], token: str | None) -> None:
        self.bases = [b.rstrip("/") for b in bases]
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.samples: list[Sample] = []
        self.failure: str | None = None

    async def _counters(
        self, session: aiohttp.ClientSession, base: str
    ) -> tuple[float, float, dict[str, list[tuple[float, float]]]] | str:
        """(tier reads, bytes written, request-time buckets) of one daemon, or why not."""
        try:
            async with session.get(base + "/metrics", headers=self.headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                text = await r.text()
        except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
            return f"{base}/metrics: {type(e).__name__}: {e}"
        return counter(text, TIER_READS), counter(text, BYTES_WRITTEN), route_buckets(text, DAEMON_ROUTES)

    async def sample(self, session: aiohttp.ClientSession, t0: float) -> None:
        """One sample, at its time from ``t0``; a failure is kept in ``failure``."""
        got = await asyncio.gather(*(self._counters(session, b) for b in self.bases))
        failed = [g for g in got if isinstance(g, str)]
        if failed:
            more = f" (and {len(failed) - 1} more members)" if len(failed) > 1 else ""
            self.failure = failed[0] + more
            return
        t = time.perf_counter() - t0
        values = [g for g in got if not isinstance(g, str)]
        buckets: dict[str, dict[float, float]] = {}
        for v in values:
            for route, pairs in v[2].items():
                summed = buckets.setdefault(route, {})
                for le, count in pairs:
                    summed[le] = summed.get(le, 0.0) + count
        merged = {route: sorted(b.items()) for route, b in buckets.items()}
        self.samples.append(Sample(t, sum(v[0] for v in values), sum(v[1] for v in values), merged))

    async def follow(self, session: aiohttp.ClientSession, stop: asyncio.Event, t0: float) -> None:
        """A sample a period until ``stop``, and a last one once the workers'
        snapshots hold the last requests."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(METRICS_EVERY_S):
                    await stop.wait()
            if stop.is_set():
                await asyncio.sleep(SNAPSHOT_WAIT_S)
            await self.sample(session, t0)


# (a load is a GET per block of a direct tenant, a batch get of a sealed one's)
DAEMON_ROUTES = {
    "lookup": "/v1/lookup",
    "block GET": "/v1/blocks/{key}",
    "batch get": "/v1/batch/get",
    "batch put": "/v1/batch/put",
}
REQUEST_SECONDS = "kvstore_http_request_seconds_bucket"


EVICTION_STEP = "kvstore_quota_eviction_step_seconds_bucket"


def route_buckets(text: str, routes: dict[str, str]) -> dict[str, list[tuple[float, float]]]:
    """The cumulative buckets (le, count) of ``kvstore_http_request_seconds``
    for each of ``routes`` (name -> route), every method summed; and of
    ``kvstore_quota_eviction_step_seconds`` (as "eviction step")."""
    found: dict[str, dict[float, float]] = {}
    by_route = {route: name for name, route in routes.items()}
    for line in text.splitlines():
        if line.startswith(EVICTION_STEP + "{"):
            series, labels, value = "eviction step", *line[len(EVICTION_STEP) + 1 :].rsplit("} ", 1)
        elif line.startswith(REQUEST_SECONDS + "{"):
            series, labels, value = "", *line[len(REQUEST_SECONDS) + 1 :].rsplit("} ", 1)
        else:
            continue
        fields = dict(part.split("=", 1) for part in labels.split(","))
        name = series or by_route.get(fields.get("route", "").strip('"'))
        if name is not None:
            le = float(fields["le"].strip('"').replace("+Inf", "inf"))
            got = found.setdefault(name, {})
            got[le] = got.get(le, 0.0) + float(value)
    return {name: sorted(b.items()) for name, b in found.items()}


def block_key(prefix: str, block_id: int) -> str:
    """Trace block ``block_id``'s key: ``prefix`` and 16 hex digits of a
    hash of the id, so that keys sort in no order of the chains (as an
    engine's content hashes; ``prefix`` + the id would sort a chain's first
    blocks before its later ones, and an eviction that breaks ties by key
    would take chains from their head)."""
    return prefix + hashlib.blake2b(block_id.to_bytes(8, "little", signed=True), digest_size=8).hexdigest()


def counter(text: str, name: str) -> float:
    """The sum of ``name``'s samples (every label set) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(None, 1)[1])
    return total


@dataclass(slots=True)
class Replayed:
    served: list[Served]
    seconds: float
    blocks_held: int | None  # the run's distinct keys over every member
    metrics: Metrics
    errors: dict[str, int] = field(default_factory=dict)
    held_failure: str | None = None
    members: list[str] = field(default_factory=list)  # the daemons read from: one, or a fleet's at the start
    members_after: list[str] = field(default_factory=list)  # a fleet's members as the client knew them at the end
    held_by_member: dict[str, int] | None = None  # the run's keys listed on each member


async def replay(
    opts: ReplayOptions, requests: Sequence[Request], endpoints: Sequence[str], token: str, run_id: str
) -> Replayed:
    """The replay against ``endpoints`` (one daemon, or with ``opts.fleet`` the
    seeds of a fleet), then the blocks the run holds there (on every member)."""
    pool = load_pool(SAMPLES)
    blocks = BlockBytes(opts.block_bytes, pool, int(run_id, 16))
    rec = Recorder()
    stop = asyncio.Event()
    pool_size = max(64, 4 * opts.concurrency)
    client = AsyncClient(
        list(endpoints), token, timeout=opts.timeout, strict=True, pool_size=pool_size, fleet=opts.fleet
    )
    async with client, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        try:
            urls = await members(client)
        except RuntimeError as e:
            raise ValueError(f"argument --endpoint: {e} (seeds {', '.join(endpoints)})") from None
        metrics = Metrics(urls, opts.metrics_token)
        replayer = Replayer(client, opts, blocks, run_id)
        progress = Progress("replay", rec, None, len(requests), opts.progress)
        rec.t0 = time.perf_counter()
        await metrics.sample(session, rec.t0)  # before the first request: the counters' base
        watchers = [progress.loop(stop), metrics.follow(session, stop, rec.t0)]
        tasks = [asyncio.create_task(w) for w in watchers]
        try:
            served = await drive(replayer, requests, rec)
            seconds = time.perf_counter() - rec.t0
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        done = Replayed(served, seconds, None, metrics, dict(rec.errors), members=urls)
        try:
            listed = await held_keys(client, run_id)
            done.held_by_member = {u: len(keys) for u, keys in listed.items()}
            done.blocks_held = len(set().union(*listed.values()))
        except Exception as e:  # noqa: BLE001 - the figures that need it say it is unknown
            done.held_failure = f"{error_kind(e)}: {e}"
        done.members_after = client.endpoints
    return done
