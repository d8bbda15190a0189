"""The asyncio client: its public calls and the fail-open contract.

In the default, non-strict mode a call never raises (except for the caller's
own cancellation): a failure is a miss (``get`` -> None, ``exists`` -> False,
``lookup`` -> 0, ``put`` -> False), counted in :attr:`AsyncClient.stats` and
logged (at most one line per ``log_interval`` seconds). With ``strict=True``
failures raise :class:`~kvstore_client.errors.KVStoreClientError` subclasses.

Keys are spread over the endpoints by rendezvous (highest random weight)
hashing; with ``replicas`` = R > 1 a block is written to its top R endpoints
and reads try them in rank order (kvstore_client/sharding.py). Every call
has a deadline, retries and per-endpoint circuit breakers
(kvstore_client/exchange.py). The work is done by one module per concern:
reads (kvstore_client/reads/, whose path.py holds the order get_into tries
its transports in), writes.py, lookups.py.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from kvstore_client.answers import NOT_ADMITTED
from kvstore_client.bodies import writable_view
from kvstore_client.breaker import CircuitBreaker
from kvstore_client.decoding import Decode, DecodePool, decode_allowed, decode_available
from kvstore_client.errors import KVStoreClientError
from kvstore_client.exchange import Endpoint, Exchange
from kvstore_client.fleet import FleetMembers
from kvstore_client.keys import check_key
from kvstore_client.lookups import Locks, Lookups
from kvstore_client.nixl import nixl_available
from kvstore_client.nixl_link import NixlLink
from kvstore_client.plans import Plan, PlanConnection, PlannedBlock
from kvstore_client.prefix import PROCESS, Bandwidth, PrefixLoads
from kvstore_client.reads.base import Outcome
from kvstore_client.reads.batch import BatchGet
from kvstore_client.reads.http import HttpReader
from kvstore_client.reads.nixl import NixlReader
from kvstore_client.reads.path import ReadPath
from kvstore_client.reads.path_plan import PathPlanReader
from kvstore_client.reads.records import RecordReader
from kvstore_client.reads.unix_plan import UnixPlanReader
from kvstore_client.sharding import UNIX, Shards
from kvstore_client.sharding import normalize as _normalize
from kvstore_client.wire.batchframe import BufferLike
from kvstore_client.write_plans import UnixPlanWriter, UploadPlanWriter
from kvstore_client.writes import Writes

T = TypeVar("T")


class AsyncClient:
    """Client of one or more kvstore daemons (``endpoints``: ``http[s]://host:port``,
    or ``unix:PATH`` for a daemon's unix socket on this host).

    The token is ``token``, else ``$KVSTORE_TOKEN``, else the content of
    ``token_file`` or ``$KVSTORE_TOKEN_FILE``. ``token`` may also map endpoints
    to their own tokens (tenants are per daemon); unmapped endpoints use the default.

    On ``unix:`` endpoints, ``get_into`` reads direct blocks from the segment
    files (``read_plans``) and ``put_many`` writes them there
    (``write_plans``: reserved by the daemon, written here, checked and
    indexed by the daemon). A sealed tenant's records are sealed here for a
    write plan on ``unix:`` (``encode`` "client" or "auto": the daemon gives
    each record its own key, never the tenant's), and with ``encode="client"``
    also on TLS and loopback endpoints, where the sealed frames are uploaded
    into the plan (a request per block: less daemon CPU than a PUT, not more
    speed); else they go over HTTP and the daemon seals them.
    """

    def __init__(
        self,
        endpoints: list[str] | str,
        token: str | Mapping[str, str] | None = None,
        *,
        token_file: str | None = None,
        timeout: float = 2.0,
        retries: int = 2,
        backoff: float = 0.05,
        backoff_max: float = 1.0,
        strict: bool = False,
        ca_file: str | None = None,
        replicas: int = 1,
        breaker_threshold: int = 5,
        breaker_cooldown: float = 5.0,
        pool_size: int = 64,
        max_batch_keys: int = 1024,
        max_lookup_keys: int = 4096,
        log_interval: float = 10.0,
        read_plans: bool = True,
        write_plans: bool = True,
        decode: Decode = "auto",
        encode: Literal["server", "client", "auto"] = "auto",
        decode_threads: int | None = None,
        plan_paths: bool = False,
        transport: Literal["http", "nixl"] = "http",
        nixl_name: str | None = None,
        nixl_devices: str | None = None,
        fleet: bool = False,
        fleet_refresh_s: float = 5.0,
    ) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ValueError("at least one endpoint is needed")
        urls = [_normalize(e) for e in eps]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate endpoints in {urls}")
        if not 1 <= replicas <= len(urls):
            raise ValueError(f"replicas must be 1 to {len(urls)} (the number of endpoints), got {replicas}")
        if timeout <= 0 or retries < 0:
            raise ValueError("timeout must be > 0 and retries >= 0")
        tokens: dict[str, str] = {}
        if isinstance(token, Mapping):
            tokens = {_normalize(k): v for k, v in token.items()}
            token = None
        self.token = token or os.environ.get("KVSTORE_TOKEN") or self._read_token(token_file)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.strict = strict
        self.replicas = replicas
        self.pool_size = pool_size
        self.max_batch_keys = max_batch_keys
        self.max_lookup_keys = max_lookup_keys
        self.read_plans = read_plans
        self.write_plans = write_plans
        self.plan_paths = plan_paths
        _check_codec_side("decode", decode, urls)
        if decode_threads is not None and decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        self.decode = decode
        _check_codec_side("encode", encode, urls)
        self.encode = encode
        self.decode_threads = decode_threads or min(8, os.cpu_count() or 1)
        if transport not in ("http", "nixl"):
            raise ValueError(f"transport must be 'http' or 'nixl', got {transport!r}")
        if transport == "nixl" and not nixl_available():
            raise ValueError("transport='nixl' needs NIXL: pip install --no-deps nixl-cu12 nixl (see README)")
        self.transport = transport

        decodes = decode != "server" and decode_available()

        def endpoint(u: str) -> Endpoint:
            return Endpoint(
                u,
                CircuitBreaker(breaker_threshold, breaker_cooldown),
                tokens.get(u, self.token),
                client_decode=decodes and decode_allowed(u),
            )

        endpoints_ = {u: endpoint(u) for u in urls}
        self._x = Exchange(
            endpoints_,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            backoff_max=backoff_max,
            pool_size=pool_size,
            ssl_context=ssl.create_default_context(cafile=ca_file) if ca_file else None,
            log_interval=log_interval,
        )
        self.stats: dict[str, int] = self._x.stats
        self._shards = Shards(urls, replicas)
        self._decoders = DecodePool(self.decode_threads)
        self._nixl = NixlLink(self._x, nixl_name, nixl_devices) if transport == "nixl" else None
        self._unix_plans = UnixPlanReader(
            self._x, self._shards, self._decoders, enabled=read_plans, decode=decode, max_batch_keys=max_batch_keys
        )
        self._path_plans = PathPlanReader(
            self._x, self._shards, self._decoders, enabled=plan_paths and read_plans, decode=decode
        )
        self._http = HttpReader(self._x, self._shards, RecordReader(self._x, self._decoders, decode))
        self._reads = ReadPath(
            NixlReader(self._x, self._shards, self._nixl, max_batch_keys) if self._nixl is not None else None,
            self._unix_plans,
            self._path_plans,
            self._http,
        )
        self._bandwidth = Bandwidth(PROCESS)
        self._prefix = PrefixLoads(self._reads, self._shards, self._bandwidth)
        self._batch_get = BatchGet(self._x, self._shards, max_batch_keys=max_batch_keys, strict=strict)
        self._writes = Writes(
            self._x,
            self._shards,
            self._nixl,
            UnixPlanWriter(
                self._x,
                enabled=write_plans,
                max_batch_keys=max_batch_keys,
                client_encode=encode != "server" and decode_available(),
                pool=self._decoders.get,
            ),
            UploadPlanWriter(self._x, enabled=encode == "client", pool=self._decoders.get),
            max_batch_keys=max_batch_keys,
            strict=strict,
        )
        self._lookups = Lookups(self._x, self._shards, max_lookup_keys=max_lookup_keys)
        # fleet: the endpoints are seeds; the members come from GET /v1/fleet (kvstore_client/fleet.py).
        self._fleet = FleetMembers(self._x, self._shards, urls, fleet_refresh_s, endpoint) if fleet else None
        if self._fleet is not None:  # a write a node refused (421: another's key) goes where the fleet places it
            fleet_members = self._fleet
            self._writes.follow(fleet_members.misdirected, lambda: fleet_members.version)

    @staticmethod
    def _read_token(token_file: str | None) -> str | None:
        path = token_file or os.environ.get("KVSTORE_TOKEN_FILE")
        if not path:
            return None
        return Path(path).read_text().strip()

    # -- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        self._x.closed = True
        if self._nixl is not None:  # leases of verified reads still to release
            await self._nixl.flush()
        await self._x.close()
        self._decoders.close()
        if self._nixl is not None:
            self._nixl.close()

    @property
    def endpoints(self) -> list[str]:
        return list(self._shards.urls)

    def breaker_state(self, endpoint: str) -> str:
        return self._x.endpoints[_normalize(endpoint)].breaker.state

    def owners(self, key: str) -> list[str]:
        """The endpoints that hold ``key``, in the order reads try them."""
        return self._shards.owners(key)

    # -- fail-open -------------------------------------------------------------

    async def members(self) -> None:
        """A fleet client: read the fleet's membership now if it is due (every
        ``fleet_refresh_s``, or sooner while a member looks down). Every call
        does it first; it never raises (the endpoints stay as they were)."""
        if self._fleet is None:
            return
        try:
            await self._fleet.ensure()
        except Exception as e:  # noqa: BLE001 - fail-open: the last membership stands
            self._x.log.warning("kvstore: reading the fleet's membership failed: %r", e)

    @property
    def fleet_version(self) -> int | None:
        """The fleet membership's version this client places keys by (None: not a fleet client)."""
        return self._fleet.version if self._fleet is not None else None

    async def _guard(self, op: str, default: T, call: Awaitable[T]) -> T:
        """Fail-open: a failure is ``default`` plus a counter and a log line, unless strict."""
        self.stats["calls"] += 1
        await self.members()
        try:
            return await call
        except KVStoreClientError as e:
            self.stats["errors"] += 1
            if self.strict:
                raise
            self._x.log.warning("kvstore %s failed (fail-open): %s", op, e)
            return default
        except Exception as e:  # the fail-open contract: never raise
            self.stats["errors"] += 1
            if self.strict:
                raise KVStoreClientError(f"{type(e).__name__}: {e}", code="client_error") from e
            self._x.log.warning("kvstore %s failed (fail-open): %r", op, e)
            return default

    def _count(self, hit: bool) -> None:
        self.stats["hits" if hit else "misses"] += 1

    # -- single-key calls ------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        """The block, or None if absent (or on any failure, in non-strict mode)."""
        result = await self._guard("get", None, self._get(key, None))
        self._count(result is not None)
        return result

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``start`` (inclusive) to ``end`` (exclusive) of the block, like ``block[start:end]``
        (shorter at the block's end); None if absent or ``start`` is past the end."""
        if not 0 <= start < end:
            raise ValueError(f"need 0 <= start < end, got {start}, {end}")
        result = await self._guard("get_range", None, self._get(key, (start, end)))
        self._count(result is not None)
        return result

    async def _get(self, key: str, rng: tuple[int, int] | None) -> bytes | None:
        check_key(key)
        return await self._http.get(key, rng)

    async def get_into(self, key: str, buf: Any) -> int | None:
        """Read the block straight into ``buf`` (bytearray, memoryview, numpy
        array: any writable C-contiguous buffer), chunk by chunk, without a
        whole-block copy. Returns the bytes written, None if absent. A block
        larger than ``buf`` is an error (BufferTooSmall; a miss if not strict).
        The transports are tried in the order of kvstore_client/reads/path.py."""
        mv = writable_view(buf)
        result = await self._guard("get_into", None, self._get_into(key, mv))
        self._count(result is not None)
        return result

    async def _get_into(self, key: str, mv: memoryview) -> int | None:
        check_key(key)
        outcome = (await self._reads.read([key], [mv]))[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def exists(self, key: str) -> bool:
        async def run() -> bool:
            check_key(key)
            return await self._http.exists(key)

        result = await self._guard("exists", False, run())
        self._count(result)
        return result

    async def put(self, key: str, data: BufferLike, meta: Mapping[str, Any] | None = None) -> bool:
        """Store ``data`` under ``key`` on its owner(s); True if at least one stored
        it (or already had it: first write wins). ``meta``: the engine's
        identity of the block (``block_hash``, ``parent_block_hash``,
        ``token_ids``, ``block_size``, ...), told in the residency events.
        False, without a failure, when its tenant's admission (``admit_after``)
        declined it: counted in ``stats["puts_not_admitted"]``."""
        result = await self._guard("put", None, self._writes.put(key, data, meta))
        self.stats["puts"] += 1
        if result == NOT_ADMITTED:
            self.stats["puts_not_admitted"] += 1
        elif result is None:
            self.stats["put_failures"] += 1
        return result in (200, 201)

    async def delete(self, key: str) -> bool:
        """Delete ``key`` from its owners; True if any had it."""
        return await self._guard("delete", False, self._writes.delete(key))

    # -- read plans ------------------------------------------------------------

    async def read_plan(self, keys: Sequence[str], lease_s: float | None = None, paths: bool = False) -> Plan:
        """A read plan of ``keys`` from the first owner of the first key:
        where each block's bytes are, with the files' descriptors (a
        ``unix:`` endpoint) or, with ``paths``, their paths on a shared
        filesystem (any endpoint of a daemon with ``plan_paths`` on; the data
        directory mounted at the same path here). Read a block with
        :meth:`read_planned`, release the plan with :meth:`release_plan` (or
        let it expire)."""
        if not keys:
            raise ValueError("a read plan needs at least one key")
        for k in keys:
            check_key(k)
        url = self.owners(keys[0])[0]
        ep = self._x.endpoints[url]
        if not url.startswith(UNIX):
            if not paths:
                raise ValueError(f"read plans with descriptors need a unix:PATH endpoint, not {url}; ask for paths")
            return await self._path_plans.plan(ep, list(keys), lease_s)
        conn = self._unix_plans.connection(url) or PlanConnection(url[len(UNIX) :], ep.token)
        ep.plans = conn
        return await asyncio.to_thread(conn.plan, list(keys), lease_s, paths)

    async def read_planned(self, block: PlannedBlock, buf: Any) -> int:
        """Read a planned block into ``buf`` (checked; a CUDA buffer via kvikio)."""
        return await asyncio.to_thread(PlanConnection.read_into, block, buf, self._decoders.get())

    async def release_plan(self, plan: Plan) -> None:
        """Let the daemon compact and drop the plan's segments again."""
        if plan.endpoint is not None:
            await self._path_plans.release(self._x.endpoints[plan.endpoint], plan.lease)
            return
        conn = self._x.endpoints[UNIX + plan.path].plans
        if conn is not None:
            await asyncio.to_thread(conn.release, plan.lease)

    # -- lookup ----------------------------------------------------------------

    async def lookup(self, keys: Sequence[str], tokens_per_block: int | None = None) -> int:
        """How many keys from the start of ``keys`` are stored (0 on failure).
        ``tokens_per_block``: the engine's, for the daemon's hit rate in tokens."""
        present = await self.lookup_detail(keys, tokens_per_block)
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n

    async def lookup_detail(self, keys: Sequence[str], tokens_per_block: int | None = None) -> list[bool]:
        """Per key, whether it is stored (False on failure)."""
        keys = list(keys)
        return await self._guard("lookup", [False] * len(keys), self._lookups.lookup(keys, tokens_per_block))

    async def lookup_and_lock(self, keys: Sequence[str], lease_s: float = 30.0) -> tuple[list[bool], Locks]:
        """Per key, whether it is stored, the stored ones locked: neither
        evicted (quota), expired (TTL) nor compacted until
        :meth:`release_locks` or ``lease_s`` seconds (at most 600). One lookup
        call per daemon (per ``max_lookup_keys`` keys). On failure: all False
        and nothing locked (a key a failed call asked for is a miss)."""
        if isinstance(lease_s, bool) or not 0 < lease_s <= 600:
            raise ValueError(f"lease_s must be in (0, 600] seconds, got {lease_s!r}")
        keys = list(keys)
        leases: list[tuple[str, str]] = []

        async def run() -> list[bool]:
            try:
                return await self._lookups.lookup(keys, None, lease_s, leases)
            except BaseException:
                # A failure after some daemons pinned keys: those pins are not
                # reported, so they are released here (or expire).
                if leases:
                    await asyncio.shield(self._lookups.release(leases))
                raise

        present = await self._guard("lookup_and_lock", [False] * len(keys), run())
        return present, Locks(tuple(leases))

    async def release_locks(self, locks: Locks) -> Locks:
        """End the leases of a :meth:`lookup_and_lock`: what is still to
        release (empty when done). A lease the daemon no longer knows
        (expired, or released before) counts as released; a daemon that
        cannot be reached keeps its lease in the answer, to try again (it
        expires on its own in any case). Never raises but for cancellation."""
        if not locks.leases:
            return locks
        try:
            left = await self._lookups.release(list(locks.leases))
        except Exception as e:  # noqa: BLE001 - fail-open: the leases expire on their own
            self._x.log.warning("kvstore release of locks failed: %r", e)
            return locks
        return Locks(tuple(left))

    # -- listing ---------------------------------------------------------------

    async def list_keys(
        self, prefix: str = "", start_after: str | None = None, limit: int = 1000, endpoint: str | None = None
    ) -> tuple[list[tuple[str, int]], str | None]:
        """A page of the keys (with their sizes) one daemon holds for this
        tenant: ``endpoint`` (default the first), those starting with
        ``prefix``, in byte order after ``start_after``; and where the next
        page starts (None: the last page). Keys are sharded: list every
        endpoint for all of them. Raises on failure, even when not strict (an
        empty page would be a wrong answer, not a miss)."""
        url = _normalize(endpoint) if endpoint is not None else self.endpoints[0]
        if url not in self._x.endpoints:
            raise ValueError(f"{endpoint!r} is not one of this client's endpoints")
        return await self._lookups.list_keys(url, prefix, start_after, limit)

    async def read_limit(self) -> float | None:
        """The tenant's QoS read limit (bytes per second; the daemon's ``qos``
        in ``GET /v1/stats``), the lowest of its endpoints': a bound on any
        load's bandwidth. None: no limit, or not known (fail-open)."""

        async def one(url: str) -> float | None:
            doc = await self._lookups.stats(url)
            qos = doc.get("qos")
            rate = qos.get("read_bytes_per_s") if isinstance(qos, dict) else None
            return float(rate) if isinstance(rate, int | float) and rate > 0 else None

        async def run() -> float | None:
            found = [r for r in await asyncio.gather(*(one(u) for u in self.endpoints)) if r is not None]
            return min(found) if found else None

        return await self._guard("read_limit", None, run())

    # -- loads against the clock -----------------------------------------------

    async def get_prefix(self, keys: Sequence[str], bufs: Sequence[Any], deadline_s: float) -> int:
        """Read the blocks of ``keys`` in order into ``bufs`` (as
        ``get_many_into``) for at most ``deadline_s`` seconds, and return
        ``n``: the number of leading keys whose blocks are complete in their
        buffers (every transport's checks passed). It returns as soon as all
        are in, at the first miss or failure, or at the deadline (within
        kvstore_client.prefix.DEADLINE_SLACK_S on a loaded machine), and never
        raises for a failed read, in strict mode too: what did not arrive is
        what the caller recomputes. Nothing writes into ``bufs[:n]`` after it
        returns; reads still running past the deadline may write into
        ``bufs[n:]`` until ``await wait_loads()`` returns (kvstore_client/prefix.py)."""
        keys = list(keys)
        if len(bufs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        if not deadline_s >= 0:
            raise ValueError(f"deadline_s must be >= 0, got {deadline_s}")
        for k in keys:
            check_key(k)
        mvs = [writable_view(b) for b in bufs]
        self.stats["calls"] += 1
        await self.members()
        n = await self._prefix.load(keys, mvs, deadline_s)
        self.stats["hits"] += n
        self.stats["misses"] += len(keys) - n
        return n

    async def wait_loads(self) -> None:
        """Until every read that a ``get_prefix`` left running at its deadline
        has ended: from then on nothing writes into the buffers it was given."""
        await self._prefix.wait()

    def bandwidth(self, endpoint: str | None = None, transport: str | None = None) -> float | None:
        """Bytes per second measured from this client's loads (``get_prefix``,
        ``get_many_into``) from ``endpoint`` over ``transport`` (nixl, unix,
        paths, http; None: any, the slowest of those measured), or None before
        a load has said (kvstore_client/prefix.py)."""
        return self._bandwidth.get(_normalize(endpoint) if endpoint is not None else None, transport)

    # -- batches ---------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The blocks of ``keys`` (None where absent or failed), via ``/v1/batch/get``."""
        keys = list(keys)
        misses: list[bytes | None] = [None] * len(keys)
        result = await self._guard("get_many", misses, self._get_many(keys))
        for r in result:
            self._count(r is not None)
        return result

    async def _get_many(self, keys: list[str]) -> list[bytes | None]:
        for k in keys:
            check_key(k)
        t0 = time.monotonic()
        blobs = await self._batch_get.get_many(keys)
        sizes: list[Outcome] = [None if b is None else len(b) for b in blobs]
        self._prefix.measure(keys, sizes, ["http"] * len(keys), time.monotonic() - t0)
        return blobs

    async def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[int | None]:
        """Read each of ``keys`` into the buffer at the same place in ``bufs``
        (as ``get_into``): the bytes written, None where absent (or failed,
        a buffer too small included, in non-strict mode: the other keys are
        still read; strict mode raises the first error). Over NIXL the batch takes one control call and
        one transfer per owner; over unix sockets one read plan per owner;
        otherwise the keys are read concurrently."""
        keys = list(keys)
        if len(bufs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        mvs = [writable_view(b) for b in bufs]
        misses: list[int | None] = [None] * len(keys)
        result = await self._guard("get_many_into", misses, self._get_many_into(keys, mvs))
        for r in result:
            self._count(r is not None)
        return result

    async def _get_many_into(self, keys: list[str], mvs: list[memoryview]) -> list[int | None]:
        for k in keys:
            check_key(k)
        via = [""] * len(keys)
        t0 = time.monotonic()
        outcomes = await self._reads.read(keys, mvs, via)
        self._prefix.measure(keys, outcomes, via, time.monotonic() - t0)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        for e in errors:
            if not isinstance(e, KVStoreClientError) or self.strict:
                raise e
        if errors:
            self._x.log.warning("kvstore get_many_into: %d keys failed, first: %s", len(errors), errors[0])
        return [None if isinstance(o, BaseException) else o for o in outcomes]

    async def put_many(
        self,
        items: Iterable[tuple[str, BufferLike]],
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[bool]:
        """Store many blocks with ``/v1/batch/put``; per item, whether it is
        stored (False for a block its tenant's admission declined, see
        :meth:`put_many_detail`). ``metas``: each item's engine identity (as
        ``put``), or None."""
        return [s in (200, 201) for s in await self.put_many_detail(items, metas)]

    async def put_many_detail(
        self,
        items: Iterable[tuple[str, BufferLike]],
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[int | None]:
        """:meth:`put_many`, per item: 201 (this call stored it), 200 (it was
        stored already: first write wins), 202 (not stored, not a failure:
        its tenant's admission, ``admit_after``, declined it; counted in
        ``stats["puts_not_admitted"]``) or None (failed)."""
        items = list(items)
        if metas is not None and len(metas) != len(items):
            raise ValueError(f"{len(items)} items but {len(metas)} metas")
        failed: list[int | None] = [None] * len(items)
        result = await self._guard("put_many", failed, self._writes.put_many(items, metas))
        self.stats["puts"] += len(items)
        self.stats["put_failures"] += result.count(None)
        self.stats["puts_not_admitted"] += result.count(NOT_ADMITTED)
        return result


def _check_codec_side(name: str, mode: str, urls: Sequence[str]) -> None:
    """``decode`` or ``encode``: "server", "client" or "auto"; "client" needs
    the codec installed and endpoints where a record's own key may go."""
    if mode not in ("server", "client", "auto"):
        raise ValueError(f"{name} must be 'server', 'client' or 'auto', got {mode!r}")
    if mode != "client":
        return
    if not decode_available():
        raise ValueError(f"{name}='client' needs pip install 'kvstore-client[decode]' (cryptography, zstandard, numpy)")
    refused = [u for u in urls if not decode_allowed(u)]
    if refused:
        raise ValueError(
            f"{name}='client' needs TLS, a unix socket or loopback; {refused[0]} is none of them"
            f" (a record's own key would cross the network in clear): use {name}='auto' or 'server'"
        )
