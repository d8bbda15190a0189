"""The asyncio client: fail-open, deadlines, retries, circuit breakers, sharding.

Contract: every call has a deadline (``timeout`` seconds, retries included).
Retryable failures (connection errors, 429, 502, 503, 504, 507) are retried
with exponential backoff and full jitter while the deadline allows. Each
endpoint has a circuit breaker: after ``breaker_threshold`` consecutive
failures (connection errors, timeouts, 502/503/504) it opens and calls to that
endpoint return at once; after ``breaker_cooldown`` seconds one probe is let
through, and its success closes the breaker again.

In the default, non-strict mode a call never raises (except for the caller's
own cancellation): a failure is a miss (``get`` -> None, ``exists`` -> False,
``lookup`` -> 0, ``put`` -> False), counted in :attr:`AsyncClient.stats` and
logged (at most one line per ``log_interval`` seconds). With ``strict=True``
failures raise :class:`~kvstore_client.errors.KVStoreClientError` subclasses.

Keys are spread over the endpoints by rendezvous (highest random weight)
hashing; with ``replicas`` = R > 1 a block is written to its top R endpoints
and reads try them in rank order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
import aiohttp.abc
import aiohttp.payload

from kvstore_client import framing
from kvstore_client.breaker import CircuitBreaker
from kvstore_client.errors import (
    BufferTooSmall,
    CircuitOpenError,
    CorruptBlock,
    DeadlineExceeded,
    KVStoreClientError,
    ProtocolError,
    ServerError,
    UnavailableError,
)
from kvstore_client.nixl import NixlAgent, NixlFallback, nixl_available
from kvstore_client.plans import Plan, PlanConnection, PlannedBlock, parse_plan
from kvstore_client.sharding import UNIX, rank_endpoints
from kvstore_client.sharding import normalize as _normalize

if TYPE_CHECKING:
    from kvstore_client.record import RecordOpener

log = logging.getLogger("kvstore_client")

T = TypeVar("T")

# Stored frames up to this size are decoded on the event loop (tens of microseconds).
INLINE_DECODE_BYTES = 16 << 10
RETRYABLE_STATUSES = frozenset({429, 502, 503, 504, 507})
BREAKER_STATUSES = frozenset({502, 503, 504})
_STAT_NAMES = (
    "plan_reads",  # get_into served from a read plan (the segment file, no HTTP body)
    "plan_fallbacks",  # get_into that fell back to GET (sealed, object tier only, plan failed)
    "client_decodes",  # reads of records as stored, checked and decoded here (decode="client"/"auto")
    "nixl_reads",  # get_into served over NIXL (transport="nixl")
    "nixl_writes",  # blocks put over NIXL
    "nixl_fallbacks",  # NIXL reads or write batches that went over HTTP instead
    "calls",
    "hits",
    "misses",
    "errors",
    "timeouts",
    "retries",
    "breaker_open",
    "breaker_trips",
    "puts",
    "put_failures",
)


@dataclass
class _Endpoint:
    url: str
    breaker: CircuitBreaker
    session: aiohttp.ClientSession | None = None
    plans: PlanConnection | None = None  # unix: endpoints, read plans
    paths_offered: bool = True  # http(s) endpoints: False once the daemon answered paths_not_offered
    client_decode: bool = False  # read records as stored and decode them here
    nixl: bool = True  # transport="nixl": False once the daemon answered nixl_disabled


@dataclass(frozen=True, slots=True)
class Locks:
    """The leases a :meth:`AsyncClient.lookup_and_lock` took: (endpoint URL,
    lease id), one per daemon call that found keys."""

    leases: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.leases)


Decode = Literal["server", "client", "auto"]
_LOOPBACK_HOSTS = frozenset({"localhost", "::1", "ip6-localhost"})


def decode_allowed(url: str) -> bool:
    """Whether a daemon hands records with their keys out on ``url``: a
    unix socket, TLS, or a loopback address (it checks the same itself)."""
    if url.startswith(UNIX):
        return True
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return parts.scheme == "https" or host in _LOOPBACK_HOSTS or host.startswith("127.")


def decode_available() -> bool:
    """Whether this process can open records itself (``pip install
    'kvstore-client[decode]'``: cryptography, zstandard, numpy)."""
    try:
        import kvstore_client.record  # noqa: F401
    except ImportError:
        return False
    return True


class _ServerDecodes(Exception):
    """The daemon refused to send a record as stored here: GET the block."""


@dataclass
class _RateLimitedLog:
    interval: float
    last: float = field(default=-1e18)
    suppressed: int = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        extra = f" ({self.suppressed} similar messages suppressed)" if self.suppressed else ""
        self.last, self.suppressed = now, 0
        log.warning(msg + extra, *args)


_FALLBACK = object()  # a read plan cannot give the block: GET it


class _Miss(Exception):
    """Internal: an endpoint definitively does not have the key (404)."""


class _BuffersPayload(aiohttp.payload.Payload):
    """A request body made of buffers (bytes, memoryviews, numpy arrays), sent
    as they are: no join, no copy; written in slices so that flow control applies."""

    _CHUNK = 1 << 20

    def __init__(self, parts: Sequence[Any], content_type: str) -> None:
        views = [_byte_view(p) for p in parts]
        super().__init__(views, content_type=content_type)
        self._views = views
        self._size = sum(v.nbytes for v in views)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._views).decode(encoding, errors)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        for v in self._views:
            for at in range(0, v.nbytes, self._CHUNK):
                await writer.write(v[at : at + self._CHUNK])


def _byte_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise TypeError("blocks must be C-contiguous buffers")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _writable_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError("get_into needs a writable buffer")
    if not mv.c_contiguous:
        raise TypeError("get_into needs a C-contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


class AsyncClient:
    """Client of one or more kvstore daemons (``endpoints``: ``http[s]://host:port``,
    or ``unix:PATH`` for a daemon's unix socket on this host).

    The token is ``token``, else ``$KVSTORE_TOKEN``, else the content of
    ``token_file`` or ``$KVSTORE_TOKEN_FILE``. ``token`` may also map endpoints
    to their own tokens (tenants are per daemon); unmapped endpoints use the default.
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
        decode: Decode = "auto",
        decode_threads: int | None = None,
        plan_paths: bool = False,
        transport: Literal["http", "nixl"] = "http",
        nixl_name: str | None = None,
        nixl_devices: str | None = None,
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
        self._tokens: dict[str, str] = {}
        if isinstance(token, Mapping):
            self._tokens = {_normalize(k): v for k, v in token.items()}
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
        self.plan_paths = plan_paths
        self._ssl: ssl.SSLContext | None = ssl.create_default_context(cafile=ca_file) if ca_file else None
        if decode not in ("server", "client", "auto"):
            raise ValueError(f"decode must be 'server', 'client' or 'auto', got {decode!r}")
        if decode == "client" and not decode_available():
            raise ValueError(
                "decode='client' needs pip install 'kvstore-client[decode]' (cryptography, zstandard, numpy)"
            )
        if decode == "client":
            refused = [u for u in urls if not decode_allowed(u)]
            if refused:
                raise ValueError(
                    f"decode='client' needs TLS, a unix socket or loopback; {refused[0]} is none of them"
                    " (a record's own key would cross the network in clear): use decode='auto' or 'server'"
                )
        if decode_threads is not None and decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {decode_threads}")
        self.decode = decode
        self.decode_threads = decode_threads or min(8, os.cpu_count() or 1)
        self._decoder: ThreadPoolExecutor | None = None
        self._endpoints = {u: _Endpoint(u, CircuitBreaker(breaker_threshold, breaker_cooldown)) for u in urls}
        decodes = decode != "server" and decode_available()
        for ep in self._endpoints.values():
            ep.client_decode = decodes and decode_allowed(ep.url)
        if transport not in ("http", "nixl"):
            raise ValueError(f"transport must be 'http' or 'nixl', got {transport!r}")
        if transport == "nixl" and not nixl_available():
            raise ValueError("transport='nixl' needs NIXL: pip install --no-deps nixl-cu12 nixl (see README)")
        self.transport = transport
        self._nixl_options = (nixl_name, nixl_devices)
        self._nixl: NixlAgent | None = None
        self._urls = urls
        self._log = _RateLimitedLog(log_interval)
        self.stats: dict[str, int] = dict.fromkeys(_STAT_NAMES, 0)
        self._closed = False

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
        self._closed = True
        if self._nixl is not None:  # leases of verified reads still to release
            for ep in self._endpoints.values():
                if ep.session is not None:
                    await self._nixl.flush(ep.session, ep.url)
        for ep in self._endpoints.values():
            if ep.session is not None:
                await ep.session.close()
                ep.session = None
            if ep.plans is not None:
                ep.plans.close()
                ep.plans = None
        if self._decoder is not None:
            self._decoder.shutdown(wait=False, cancel_futures=True)
            self._decoder = None
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None

    @property
    def endpoints(self) -> list[str]:
        return list(self._urls)

    def breaker_state(self, endpoint: str) -> str:
        return self._endpoints[_normalize(endpoint)].breaker.state

    def owners(self, key: str) -> list[str]:
        """The endpoints that hold ``key``, in the order reads try them."""
        if len(self._urls) == 1:
            return list(self._urls)
        return rank_endpoints(self._urls, key)[: self.replicas]

    def _session(self, ep: _Endpoint) -> aiohttp.ClientSession:
        if self._closed:
            raise KVStoreClientError("the client is closed", code="closed")
        if ep.session is None or ep.session.closed:
            token = self._tokens.get(ep.url, self.token)
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            connector: aiohttp.BaseConnector
            base = ep.url
            if ep.url.startswith(UNIX):  # same host: the daemon's unix socket
                connector = aiohttp.UnixConnector(path=ep.url[len(UNIX) :], limit=self.pool_size)
                base = "http://localhost"
            else:
                connector = aiohttp.TCPConnector(limit=self.pool_size, ssl=self._ssl if self._ssl else True)
            ep.session = aiohttp.ClientSession(
                base, connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=None)
            )
        return ep.session

    # -- the machinery ---------------------------------------------------------

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.timeout

    async def _attempts(self, ep: _Endpoint, fn: Callable[[aiohttp.ClientSession], Awaitable[T]], deadline: float) -> T:
        """``fn`` against one endpoint with retries, the breaker and the deadline."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            if not ep.breaker.allow():
                self.stats["breaker_open"] += 1
                raise CircuitOpenError("circuit breaker open", endpoint=ep.url)
            err: KVStoreClientError
            try:
                async with asyncio.timeout_at(deadline):
                    result = await fn(self._session(ep))
            except _Miss:
                ep.breaker.success()
                raise
            except TimeoutError:
                self._breaker_failure(ep)
                self.stats["timeouts"] += 1
                raise DeadlineExceeded(f"no answer within {self.timeout} s", endpoint=ep.url) from None
            except KVStoreClientError as e:
                e.endpoint = e.endpoint or ep.url
                err = e
            except (aiohttp.ClientError, OSError) as e:
                err = UnavailableError(f"{type(e).__name__}: {e}", endpoint=ep.url)
            else:
                ep.breaker.success()
                return result
            if err.breaker_failure:
                self._breaker_failure(ep)
            else:
                ep.breaker.success()
            if not err.retryable or attempt >= self.retries:
                raise err
            delay = random.uniform(0, min(self.backoff_max, self.backoff * 2**attempt))
            if loop.time() + delay >= deadline:
                raise err
            self.stats["retries"] += 1
            await asyncio.sleep(delay)
            attempt += 1

    def _breaker_failure(self, ep: _Endpoint) -> None:
        before = ep.breaker.state
        ep.breaker.failure()
        if ep.breaker.state == "open" and before != "open":
            self.stats["breaker_trips"] += 1
            self._log.warning("kvstore endpoint %s: circuit breaker opened", ep.url)

    async def _on_owners(
        self, key: str, fn: Callable[[aiohttp.ClientSession], Awaitable[T]], deadline: float
    ) -> T | None:
        """Try ``key``'s owners in order until one has it; None if the ones that
        answered do not have it; raises the last error if none answered."""
        last: KVStoreClientError | None = None
        missed = False
        for url in self.owners(key):
            try:
                return await self._attempts(self._endpoints[url], fn, deadline)
            except _Miss:
                missed = True
            except DeadlineExceeded:
                raise
            except KVStoreClientError as e:
                last = e
        if missed or last is None:
            return None
        raise last

    async def _guard(self, op: str, default: T, call: Awaitable[T]) -> T:
        """Fail-open: a failure is ``default`` plus a counter and a log line, unless strict."""
        self.stats["calls"] += 1
        try:
            return await call
        except KVStoreClientError as e:
            self.stats["errors"] += 1
            if self.strict:
                raise
            self._log.warning("kvstore %s failed (fail-open): %s", op, e)
            return default
        except Exception as e:  # the fail-open contract: never raise
            self.stats["errors"] += 1
            if self.strict:
                raise KVStoreClientError(f"{type(e).__name__}: {e}", code="client_error") from e
            self._log.warning("kvstore %s failed (fail-open): %r", op, e)
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
        framing.check_key(key)
        headers = {"Range": f"bytes={rng[0]}-{rng[1] - 1}"} if rng else {}

        async def fn(s: aiohttp.ClientSession) -> bytes:
            if self._decodes_here(s):
                out: list[bytearray] = []

                def dest(n: int) -> memoryview:
                    out.append(bytearray(n))
                    return memoryview(out[0])

                try:
                    await self._read_record(s, key, rng, dest)
                    return bytes(out[0])
                except _ServerDecodes:
                    pass
            async with s.get(f"/v1/blocks/{key}", headers=headers) as r:
                if rng is not None and r.status == 416:
                    raise _Miss
                await _check(r, ok=(200, 206))
                data = await r.read()
                if rng is not None and r.status == 200:  # range ignored by the server
                    data = data[rng[0] : rng[1]]
                return data

        return await self._on_owners(key, fn, self._deadline())

    async def get_into(self, key: str, buf: Any) -> int | None:
        """Read the block straight into ``buf`` (bytearray, memoryview, numpy
        array: any writable C-contiguous buffer), chunk by chunk, without a
        whole-block copy. Returns the bytes written, None if absent. A block
        larger than ``buf`` is an error (BufferTooSmall; a miss if not strict)."""
        mv = _writable_view(buf)
        result = await self._guard("get_into", None, self._get_into(key, mv))
        self._count(result is not None)
        return result

    async def _get_into(self, key: str, mv: memoryview) -> int | None:
        framing.check_key(key)
        if self.transport == "nixl":
            done, got = await self._nixl_read(key, mv)
            if done:
                return got
        return await self._get_into_here(key, mv)

    async def _get_into_here(self, key: str, mv: memoryview, unix_plan: bool = True) -> int | None:
        """``get_into`` by a read plan where there is one, else HTTP
        (``unix_plan``: False when a plan on the unix socket was tried already)."""
        conn = self._plans_of(self.owners(key)[0]) if unix_plan else None
        if conn is not None:
            planned, n = await asyncio.to_thread(self._planned_read, conn, key, mv)
            if planned:
                self.stats["plan_reads"] += 1
                return n
            self.stats["plan_fallbacks"] += 1
        elif self._asks_paths(self.owners(key)[0]):
            planned, n = await self._path_read(self._endpoints[self.owners(key)[0]], key, mv)
            if planned:
                self.stats["plan_reads"] += 1
                return n
            self.stats["plan_fallbacks"] += 1

        def dest(n: int) -> memoryview:
            if n > mv.nbytes:
                raise BufferTooSmall(f"block {key} is {n} bytes; the buffer holds {mv.nbytes}")
            return mv[:n]

        async def fn(s: aiohttp.ClientSession) -> int:
            if self._decodes_here(s):
                try:
                    return await self._read_record(s, key, None, dest)
                except _ServerDecodes:
                    pass
            async with s.get(f"/v1/blocks/{key}") as r:
                await _check(r, ok=(200,))
                size = r.content_length
                if size is not None and size > mv.nbytes:
                    raise BufferTooSmall(f"block {key} is {size} bytes; the buffer holds {mv.nbytes}")
                n = 0
                async for chunk in r.content.iter_any():
                    end = n + len(chunk)
                    if end > mv.nbytes:
                        raise BufferTooSmall(f"block {key} is over {n} bytes; the buffer holds {mv.nbytes}")
                    mv[n:end] = chunk
                    n = end
                if size is not None and n != size:
                    raise UnavailableError(f"block {key}: body ended after {n} of {size} bytes")
                return n

        return await self._on_owners(key, fn, self._deadline())

    def _decodes_here(self, s: aiohttp.ClientSession) -> bool:
        """Whether reads on ``s`` (an endpoint's session) fetch records as
        stored and decode them here."""
        return any(ep.session is s and ep.client_decode for ep in self._endpoints.values())

    def _server_decodes(self, s: aiohttp.ClientSession) -> None:
        """From now on, reads on ``s``'s endpoint leave decoding to the daemon."""
        for ep in self._endpoints.values():
            if ep.session is s:
                ep.client_decode = False

    async def _read_record(
        self, s: aiohttp.ClientSession, key: str, rng: tuple[int, int] | None, dest: Callable[[int], memoryview]
    ) -> int:
        """``GET /v1/records/{key}``: the stored frames that cover the block
        (or ``rng``), each checked and decoded on the decode threads as it
        arrives, into ``dest(n)`` (n: the bytes to come). Returns n."""
        from kvstore_client import record

        headers = {"Range": f"bytes={rng[0]}-{rng[1] - 1}"} if rng else {}
        async with s.get(f"/v1/records/{key}", headers=headers) as r:
            if rng is not None and r.status == 416:
                raise _Miss
            if r.status == 403 and self.decode == "auto":
                err = _error_from(r.status, await r.read(), r)
                if err.code == "insecure_transport":  # behind a proxy, say: the daemon decodes
                    self._server_decodes(s)
                    raise _ServerDecodes
                raise err
            await _check(r, ok=(200,))
            try:
                magic, meta_len = record.HEAD.unpack(await r.content.readexactly(record.HEAD.size))
                if magic != record.MAGIC or meta_len > record.MAX_META:
                    raise ProtocolError(f"block {key}: not a record envelope", status=r.status)
                meta = record.parse_meta(await r.content.readexactly(meta_len), key)
                if rng is not None and (meta.start, meta.end) != (rng[0], min(rng[1], meta.size)):
                    raise ProtocolError(f"block {key}: the record sent covers [{meta.start}, {meta.end}), not {rng}")
                if r.content_length is not None and r.content_length != record.HEAD.size + meta_len + meta.stored_len:
                    raise ProtocolError(f"block {key}: Content-Length does not match the record envelope")
                if self.decode == "auto" and meta.frame_key is None and all(f.codec == "raw" for f in meta.frames):
                    # A direct tenant: the daemon sends its blocks with sendfile and
                    # decodes nothing, so GET (one copy fewer here) serves it better.
                    self._server_decodes(s)
                opener = record.RecordOpener(meta, dest(meta.end - meta.start))
                await self._open_frames(r, opener)
            except asyncio.IncompleteReadError as e:
                raise UnavailableError(f"block {key}: the answer ended {len(e.partial)} bytes into a part") from None
            self.stats["client_decodes"] += 1
            return meta.end - meta.start

    async def _open_frames(self, r: aiohttp.ClientResponse, opener: RecordOpener) -> None:
        """Each frame of the answer, read and handed to a decode thread; every
        thread has finished with the output when this returns or raises."""
        loop = asyncio.get_running_loop()
        pool = self._decode_pool()
        pending: list[asyncio.Future[None]] = []
        try:
            for j, f in enumerate(opener.meta.frames):
                stored = await r.content.readexactly(f.length)
                if f.length <= INLINE_DECODE_BYTES:  # cheaper here than the hop to a thread
                    opener.place(j, stored)
                else:
                    pending.append(loop.run_in_executor(pool, opener.place, j, stored))
            if await r.content.read(1):
                raise ProtocolError(f"block {opener.meta.key}: bytes after the record's last frame")
        finally:
            if pending:  # the output is the caller's buffer: no thread may write to it after we return
                await asyncio.shield(asyncio.wait(pending))
        for fut in pending:
            fut.result()

    def _decode_pool(self) -> ThreadPoolExecutor:
        """The threads that open and decode records' frames here."""
        if self._decoder is None:
            self._decoder = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="kvstore-decode")
        return self._decoder

    def _plans_of(self, url: str) -> PlanConnection | None:
        """The read-plan connection of a ``unix:`` endpoint (None: plans off or TCP)."""
        ep = self._endpoints[url]
        if not self.read_plans or not url.startswith(UNIX):
            return None
        if ep.plans is None:
            ep.plans = PlanConnection(url[len(UNIX) :], self._tokens.get(url, self.token), self.timeout)
        return ep.plans

    def _asks_paths(self, url: str) -> bool:
        """Whether get_into asks ``url`` (http or https) for plans with paths."""
        ep = self._endpoints[url]
        return self.plan_paths and self.read_plans and not url.startswith(UNIX) and ep.paths_offered

    async def _path_plan(self, ep: _Endpoint, keys: list[str], lease_s: float | None) -> Plan:
        """``POST /v1/read-plan`` with paths on an http(s) endpoint's session."""
        body: dict[str, Any] = {"keys": keys, "paths": True}
        if lease_s is not None:
            body["lease_s"] = lease_s
        try:
            async with asyncio.timeout(self.timeout):
                async with self._session(ep).post("/v1/read-plan", json=body) as r:
                    if r.status != 200:
                        err = _error_from(r.status, await r.read(), r)
                        if err.code == "paths_not_offered":
                            ep.paths_offered = False  # not asked again; read_plan still raises
                        err.endpoint = ep.url
                        raise err
                    doc = await _json(r)
        except TimeoutError:
            raise DeadlineExceeded(f"no read plan within {self.timeout} s", endpoint=ep.url) from None
        except (aiohttp.ClientError, OSError) as e:
            raise UnavailableError(f"{type(e).__name__}: {e}", endpoint=ep.url) from None
        return parse_plan(doc, "", {}, endpoint=ep.url)

    async def _release_path_plan(self, ep: _Endpoint, lease: str) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                async with self._session(ep).delete(f"/v1/read-plan/{lease}") as r:
                    if r.status != 204:
                        raise _error_from(r.status, await r.read(), r)
        except TimeoutError:
            raise DeadlineExceeded(f"no answer within {self.timeout} s", endpoint=ep.url) from None
        except (aiohttp.ClientError, OSError) as e:
            raise UnavailableError(f"{type(e).__name__}: {e}", endpoint=ep.url) from None

    async def _path_read(self, ep: _Endpoint, key: str, mv: memoryview) -> tuple[bool, int | None]:
        """``key`` read through a plan with paths into ``mv``: (True, its
        size, or None for a miss), or (False, None) when it must be read with
        GET: the plan refused (paths_not_offered, then never asked again
        here; insecure_transport for a sealed block on plain TCP; 409), or
        the file could not be read here (not mounted, no permission, gone).
        A block that fails its checksums is read with GET too (once, never
        returned): the file may have been compacted away and its name taken
        again after the lease ended; the daemon checks what it sends."""
        if ep.breaker.state != "closed":
            return False, None  # GET: the breaker decides
        try:
            plan = await self._path_plan(ep, [key], None)
        except KVStoreClientError as e:
            self._log.warning("kvstore read plan with paths failed, reading over HTTP: %s", e)
            return False, None
        try:
            block = self._from_plan(plan, key, mv)
            if block is None:
                return (True, None) if _planned_miss(plan, key) else (False, None)
            try:
                n = await asyncio.to_thread(PlanConnection.read_into, block, mv, self._decode_pool())
            except (OSError, CorruptBlock) as e:
                self._log.warning("kvstore read of %s from its path failed, reading over HTTP: %s", key, e)
                return False, None
            return True, n
        finally:
            try:
                await self._release_path_plan(ep, plan.lease)
            except KVStoreClientError as e:  # it expires on its own
                self._log.warning("kvstore read plan release failed: %s", e)

    def _from_plan(self, plan: Plan, key: str, mv: memoryview) -> PlannedBlock | None:
        """The block of ``key`` to read from ``plan`` into ``mv``; None when
        the plan does not give it (a miss, see :func:`_planned_miss`, or a GET
        to make: sealed and the daemon decodes, in the object tier only, ...).
        Raises BufferTooSmall."""
        block = plan.blocks.get(key)
        if block is None:
            return None
        if block.size > mv.nbytes:
            raise BufferTooSmall(f"block {key} is {block.size} bytes; the buffer holds {mv.nbytes}")
        if block.record is not None and self.decode == "server":
            return None  # sealed: the caller wants the daemon to decode it
        return block

    def _planned_read(self, conn: PlanConnection, key: str, mv: memoryview) -> tuple[bool, int | None]:
        """On a thread: ``key`` read through a read plan into ``mv``: (True,
        its size, or None for a miss), or (False, None) when it must be read
        with GET. A block that fails its checksum raises."""
        try:
            plan = conn.plan([key])
        except KVStoreClientError as e:
            self._log.warning("kvstore read plan failed, reading over HTTP: %s", e)
            return False, None
        try:
            block = self._from_plan(plan, key, mv)
            if block is not None:
                return True, conn.read_into(block, mv, self._decode_pool())
            return (True, None) if _planned_miss(plan, key) else (False, None)
        finally:
            try:
                conn.release(plan.lease)
            except KVStoreClientError as e:  # it expires on its own
                self._log.warning("kvstore read plan release failed: %s", e)

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
            framing.check_key(k)
        url = self.owners(keys[0])[0]
        if not url.startswith(UNIX):
            if not paths:
                raise ValueError(f"read plans with descriptors need a unix:PATH endpoint, not {url}; ask for paths")
            return await self._path_plan(self._endpoints[url], list(keys), lease_s)
        conn = self._plans_of(url) or PlanConnection(url[len(UNIX) :], self._tokens.get(url, self.token))
        self._endpoints[url].plans = conn
        return await asyncio.to_thread(conn.plan, list(keys), lease_s, paths)

    async def read_planned(self, block: PlannedBlock, buf: Any) -> int:
        """Read a planned block into ``buf`` (checked; a CUDA buffer via kvikio)."""
        return await asyncio.to_thread(PlanConnection.read_into, block, buf, self._decode_pool())

    async def release_plan(self, plan: Plan) -> None:
        """Let the daemon compact and drop the plan's segments again."""
        if plan.endpoint is not None:
            await self._release_path_plan(self._endpoints[plan.endpoint], plan.lease)
            return
        conn = self._endpoints[UNIX + plan.path].plans
        if conn is not None:
            await asyncio.to_thread(conn.release, plan.lease)

    # -- NIXL ------------------------------------------------------------------

    def _nixl_agent(self) -> NixlAgent:
        if self._nixl is None:
            self._nixl = NixlAgent(self._nixl_options[0], devices=self._nixl_options[1])
        return self._nixl

    async def _nixl_read(self, key: str, mv: memoryview) -> tuple[bool, int | None]:
        """``key`` read over NIXL into ``mv``: (True, size or None for a
        miss), or (False, None) when HTTP must serve it."""
        got = (await self._nixl_reads([key], [mv]))[0]
        if isinstance(got, BufferTooSmall):
            raise got
        return (False, None) if isinstance(got, Exception) else (True, got)

    async def _nixl_reads(self, keys: list[str], mvs: list[memoryview]) -> list[int | Exception | None]:
        """Each key read over NIXL into its buffer, one call per owner: its
        size, None for a miss, or the error that sends it to HTTP."""
        out: list[int | Exception | None] = [NixlFallback("not tried")] * len(keys)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self.owners(k)[0], []).append(i)

        async def one(url: str, idx: list[int]) -> None:
            ep = self._endpoints[url]
            if not ep.nixl or not ep.breaker.allow():
                return
            for c in range(0, len(idx), self.max_batch_keys):
                part = idx[c : c + self.max_batch_keys]
                try:
                    got = await self._nixl_agent().read_many(
                        self._session(ep),
                        ep.url,
                        [keys[i] for i in part],
                        [mvs[i] for i in part],
                        time.monotonic() + self.timeout,
                    )
                except (NixlFallback, TimeoutError, aiohttp.ClientError, OSError) as e:
                    self._nixl_failed(
                        ep, e if isinstance(e, NixlFallback) else NixlFallback(f"{type(e).__name__}: {e}")
                    )
                    return
                for i, g in zip(part, got, strict=True):
                    out[i] = g
                    if isinstance(g, NixlFallback):
                        self._nixl_failed(ep, g)
                    elif not isinstance(g, Exception):
                        self.stats["nixl_reads"] += 1

        await asyncio.gather(*(one(url, idx) for url, idx in groups.items()))
        return out

    async def _nixl_write(
        self,
        url: str,
        items: list[tuple[str, framing.BufferLike]],
        idx: list[int],
        ok: list[int | None],
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> bool:
        """Put ``items[idx]`` on ``url`` over NIXL; False: HTTP must."""
        ep = self._endpoints[url]
        if not ep.nixl or not ep.breaker.allow():
            return False
        chosen = [(items[i][0], memoryview(items[i][1]).cast("B")) for i in idx]
        ids = [metas[i] for i in idx] if metas is not None else None
        try:
            results = await self._nixl_agent().write(self._session(ep), url, chosen, ids)
        except (TimeoutError, NixlFallback, aiohttp.ClientError, OSError) as e:
            self._nixl_failed(ep, e if isinstance(e, NixlFallback) else NixlFallback(f"{type(e).__name__}: {e}"))
            return False
        for i, res in zip(idx, results, strict=True):
            _stored(ok, i, res)
        self.stats["nixl_writes"] += len(idx)
        return True

    def _nixl_failed(self, ep: _Endpoint, e: NixlFallback) -> None:
        self.stats["nixl_fallbacks"] += 1
        if e.permanent:
            ep.nixl = False
        self._log.warning("kvstore NIXL transfer with %s fell back to HTTP: %s", ep.url, e)

    async def exists(self, key: str) -> bool:
        async def run() -> bool:
            framing.check_key(key)

            async def fn(s: aiohttp.ClientSession) -> bool:
                async with s.head(f"/v1/blocks/{key}") as r:
                    await _check(r, ok=(200,))
                    return True

            return bool(await self._on_owners(key, fn, self._deadline()))

        result = await self._guard("exists", False, run())
        self._count(result)
        return result

    async def put(self, key: str, data: framing.BufferLike, meta: Mapping[str, Any] | None = None) -> bool:
        """Store ``data`` under ``key`` on its owner(s); True if at least one stored
        it (or already had it: first write wins). ``meta``: the engine's
        identity of the block (``block_hash``, ``parent_block_hash``,
        ``token_ids``, ``block_size``, ...), told in the residency events."""
        result = await self._guard("put", False, self._put(key, data, meta))
        self.stats["puts"] += 1
        if not result:
            self.stats["put_failures"] += 1
        return result

    async def _put(self, key: str, data: framing.BufferLike, meta: Mapping[str, Any] | None) -> bool:
        framing.check_key(key)
        if memoryview(data).nbytes == 0:
            raise KVStoreClientError("blocks are 1 byte or more", code="invalid_input")
        deadline = self._deadline()
        headers = {framing.META_HEADER: framing.meta_header(meta)} if meta is not None else None

        async def fn(s: aiohttp.ClientSession) -> bool:
            body = _BuffersPayload([data], "application/octet-stream")
            async with s.put(f"/v1/blocks/{key}", data=body, headers=headers) as r:
                await _check(r, ok=(200, 201))
                return True

        return await self._on_all_owners(self.owners(key), fn, deadline)

    async def _on_all_owners(
        self, urls: list[str], fn: Callable[[aiohttp.ClientSession], Awaitable[bool]], deadline: float
    ) -> bool:
        """``fn`` on every endpoint in ``urls`` at once; True if any returned True;
        raises the first error if all failed."""
        results = await asyncio.gather(
            *(self._attempts(self._endpoints[u], fn, deadline) for u in urls), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, _Miss)]
        if any(r is True for r in results):
            return True
        if errors and len(errors) == len(results):
            raise errors[0]
        return False

    async def delete(self, key: str) -> bool:
        """Delete ``key`` from its owners; True if any had it."""

        async def run() -> bool:
            framing.check_key(key)

            async def fn(s: aiohttp.ClientSession) -> bool:
                async with s.delete(f"/v1/blocks/{key}") as r:
                    await _check(r, ok=(204,))
                    return True

            return await self._on_all_owners(self.owners(key), fn, self._deadline())

        return await self._guard("delete", False, run())

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
        return await self._guard("lookup", [False] * len(keys), self._lookup(keys, tokens_per_block))

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
                return await self._lookup(keys, None, lease_s, leases)
            except BaseException:
                # A failure after some daemons pinned keys: those pins are not
                # reported, so they are released here (or expire).
                if leases:
                    await asyncio.shield(self._release_leases(leases))
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
            left = await self._release_leases(list(locks.leases))
        except Exception as e:  # noqa: BLE001 - fail-open: the leases expire on their own
            self._log.warning("kvstore release of locks failed: %r", e)
            return locks
        return Locks(tuple(left))

    async def _release_leases(self, leases: list[tuple[str, str]]) -> list[tuple[str, str]]:
        deadline = self._deadline()

        async def one(url: str, lease: str) -> bool:
            async def fn(s: aiohttp.ClientSession) -> bool:
                async with s.delete(f"/v1/leases/{lease}") as r:
                    with contextlib.suppress(_Miss):  # expired, or released already: nothing is held
                        await _check(r, ok=(204,))
                    return True

            try:
                return await self._attempts(self._endpoints[url], fn, deadline)
            except KVStoreClientError as e:
                self._log.warning("kvstore lease release at %s failed: %s", url, e)
                return False

        done = await asyncio.gather(*(one(u, lid) for u, lid in leases))
        return [ul for ul, ok in zip(leases, done, strict=True) if not ok]

    async def _lookup(
        self,
        keys: list[str],
        tokens_per_block: int | None = None,
        lease_s: float | None = None,
        leases: list[tuple[str, str]] | None = None,
    ) -> list[bool]:
        for k in keys:
            framing.check_key(k)
        deadline = self._deadline()
        present = [False] * len(keys)
        owners = [self.owners(k) for k in keys]
        errors: list[KVStoreClientError] = []
        answered = [False] * len(keys)
        for rank in range(self.replicas):
            groups: dict[str, list[int]] = {}
            for i, o in enumerate(owners):
                if not present[i] and rank < len(o):
                    groups.setdefault(o[rank], []).append(i)
            calls = []
            for url, idx in groups.items():
                for c in range(0, len(idx), self.max_lookup_keys):
                    part = idx[c : c + self.max_lookup_keys]
                    calls.append(self._lookup_chunk(url, keys, part, deadline, tokens_per_block, lease_s, leases))
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, KVStoreClientError):
                    errors.append(result)
                    continue
                if isinstance(result, BaseException):
                    raise result
                for i, p in result:
                    present[i] = present[i] or p
                    answered[i] = True
        if errors and not any(answered):
            raise errors[0]
        if errors:
            self._log.warning("kvstore lookup: %d partial failures, first: %s", len(errors), errors[0])
        return present

    async def _lookup_chunk(
        self,
        url: str,
        keys: list[str],
        idx: list[int],
        deadline: float,
        tokens_per_block: int | None = None,
        lease_s: float | None = None,
        leases: list[tuple[str, str]] | None = None,
    ) -> list[tuple[int, bool]]:
        """One ``/v1/lookup`` call; with ``lease_s``, the lease it took (if
        any key was present) is appended to ``leases``."""
        body: dict[str, Any] = {"keys": [keys[i] for i in idx]}
        if tokens_per_block:
            body["tokens_per_block"] = tokens_per_block
        if lease_s is not None:
            body["lease_s"] = lease_s

        async def fn(s: aiohttp.ClientSession) -> list[tuple[int, bool]]:
            async with s.post("/v1/lookup", json=body) as r:
                await _check(r, ok=(200,))
                doc = await _json(r)
                flags = doc.get("present")
                if not isinstance(flags, list) or len(flags) != len(idx):
                    raise ProtocolError(f"lookup answer has no 'present' list of {len(idx)} flags")
                if lease_s is not None:
                    lease = doc.get("lease")
                    if lease is None and any(flags):
                        raise ProtocolError("a lookup with lease_s found keys but named no lease (an older daemon?)")
                    if lease is not None:
                        if not isinstance(lease, str) or not lease.isalnum():
                            raise ProtocolError(f"lookup answer has a malformed lease {lease!r}")
                        assert leases is not None
                        leases.append((url, lease))
                return [(i, bool(p)) for i, p in zip(idx, flags, strict=True)]

        return await self._attempts(self._endpoints[url], fn, deadline)

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
        if url not in self._endpoints:
            raise ValueError(f"{endpoint!r} is not one of this client's endpoints")
        params = {"limit": str(limit)}
        if prefix:
            params["prefix"] = prefix
        if start_after is not None:
            params["start_after"] = start_after

        async def fn(s: aiohttp.ClientSession) -> tuple[list[tuple[str, int]], str | None]:
            async with s.get("/v1/keys", params=params) as r:
                await _check(r, ok=(200,))
                doc = await _json(r)
            try:
                keys = [(str(e["key"]), int(e["size"])) for e in doc["keys"]]
                nxt = doc["next_start_after"]
            except (KeyError, TypeError, ValueError) as e:
                raise ProtocolError(f"malformed key listing: {type(e).__name__}: {e}") from None
            return keys, (None if nxt is None else str(nxt))

        try:
            return await self._attempts(self._endpoints[url], fn, self._deadline())
        except _Miss:
            raise ProtocolError("the daemon has no key listing (404): an older version?") from None

    # -- batches ---------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The blocks of ``keys`` (None where absent or failed), via ``/v1/batch/get``."""
        keys = list(keys)
        misses: list[bytes | None] = [None] * len(keys)
        result = await self._guard("get_many", misses, self._get_many(keys))
        for r in result:
            self._count(r is not None)
        return result

    async def get_many_into(self, keys: Sequence[str], bufs: Sequence[Any]) -> list[int | None]:
        """Read each of ``keys`` into the buffer at the same place in ``bufs``
        (as ``get_into``): the bytes written, None where absent (or failed,
        a buffer too small included, in non-strict mode: the other keys are
        still read; strict mode raises the first error). Over NIXL the batch takes one control call and
        one transfer per owner; otherwise the keys are read concurrently."""
        keys = list(keys)
        if len(bufs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(bufs)} buffers")
        mvs = [_writable_view(b) for b in bufs]
        misses: list[int | None] = [None] * len(keys)
        result = await self._guard("get_many_into", misses, self._get_many_into(keys, mvs))
        for r in result:
            self._count(r is not None)
        return result

    async def _get_many_into(self, keys: list[str], mvs: list[memoryview]) -> list[int | None]:
        for k in keys:
            framing.check_key(k)
        out: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        errors: list[BaseException] = []
        if self.transport == "nixl":
            got = await self._nixl_reads(keys, mvs)
            todo = []
            for i, g in enumerate(got):
                if isinstance(g, BufferTooSmall):
                    errors.append(g)
                elif isinstance(g, Exception):
                    todo.append(i)
                else:
                    out[i] = g
        todo = await self._plan_reads_many(keys, mvs, todo, out, errors)
        results = await asyncio.gather(
            *(self._get_into_here(keys[i], mvs[i], unix_plan=False) for i in todo), return_exceptions=True
        )
        for i, r in zip(todo, results, strict=True):
            if isinstance(r, BaseException):
                errors.append(r)
            else:
                out[i] = r
        for e in errors:
            if not isinstance(e, KVStoreClientError) or self.strict:
                raise e
        if errors:
            self._log.warning("kvstore get_many_into: %d keys failed, first: %s", len(errors), errors[0])
        return out

    async def _plan_reads_many(
        self,
        keys: list[str],
        mvs: list[memoryview],
        todo: list[int],
        out: list[int | None],
        errors: list[BaseException],
    ) -> list[int]:
        """The keys of ``todo`` whose first owner is a ``unix:`` endpoint, read
        through one read plan per owner (per ``max_batch_keys``) instead of
        one per key: results into ``out`` (a 404 is a miss), errors into
        ``errors``; returns the indices left for :meth:`_get_into_here`."""
        groups: dict[str, list[int]] = {}
        left: list[int] = []
        for i in todo:
            url = self.owners(keys[i])[0]
            (groups.setdefault(url, []) if self._plans_of(url) is not None else left).append(i)
        for url, idx in groups.items():
            conn = self._plans_of(url)
            assert conn is not None
            for c in range(0, len(idx), self.max_batch_keys):
                left += await self._plan_chunk(conn, keys, mvs, idx[c : c + self.max_batch_keys], out, errors)
        return sorted(left)

    async def _plan_chunk(
        self,
        conn: PlanConnection,
        keys: list[str],
        mvs: list[memoryview],
        idx: list[int],
        out: list[int | None],
        errors: list[BaseException],
    ) -> list[int]:
        try:
            plan = await asyncio.to_thread(conn.plan, [keys[i] for i in idx])
        except KVStoreClientError as e:
            self._log.warning("kvstore read plan failed, reading over HTTP: %s", e)
            self.stats["plan_fallbacks"] += len(idx)
            return idx
        left: list[int] = []
        reads: list[int] = []
        try:
            for i in idx:
                try:
                    block = self._from_plan(plan, keys[i], mvs[i])
                except BufferTooSmall as e:
                    errors.append(e)
                    continue
                if block is not None:
                    reads.append(i)
                elif _planned_miss(plan, keys[i]):
                    out[i] = None
                else:
                    left.append(i)
            pool = self._decode_pool()
            done = await asyncio.gather(
                *(asyncio.to_thread(PlanConnection.read_into, plan.blocks[keys[i]], mvs[i], pool) for i in reads),
                return_exceptions=True,
            )
            for i, n in zip(reads, done, strict=True):
                if isinstance(n, CorruptBlock):
                    errors.append(n)  # the segment's own bytes failed their checksums: an error, as for get_into
                elif isinstance(n, OSError):
                    self._log.warning("kvstore read of %s from its segment failed, reading over HTTP: %s", keys[i], n)
                    left.append(i)
                elif isinstance(n, BaseException):
                    raise n
                else:
                    out[i] = n
                    self.stats["plan_reads"] += 1
        finally:
            try:
                await asyncio.to_thread(conn.release, plan.lease)
            except KVStoreClientError as e:  # it expires on its own
                self._log.warning("kvstore read plan release failed: %s", e)
        self.stats["plan_fallbacks"] += len(left)
        return left

    async def _get_many(self, keys: list[str]) -> list[bytes | None]:
        for k in keys:
            framing.check_key(k)
        deadline = self._deadline()
        out: list[bytes | None] = [None] * len(keys)
        owners = [self.owners(k) for k in keys]
        errors: list[KVStoreClientError] = []
        answered = False
        for rank in range(self.replicas):
            groups: dict[str, list[int]] = {}
            for i, o in enumerate(owners):
                if out[i] is None and rank < len(o):
                    groups.setdefault(o[rank], []).append(i)
            calls = [
                self._get_chunk(url, keys, idx[c : c + self.max_batch_keys], out, deadline)
                for url, idx in groups.items()
                for c in range(0, len(idx), self.max_batch_keys)
            ]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, KVStoreClientError):
                    errors.append(result)
                elif isinstance(result, BaseException):
                    raise result
                else:
                    answered = True
        if errors and (self.strict or not answered):
            raise errors[0]
        if errors:
            self._log.warning("kvstore get_many: %d partial failures, first: %s", len(errors), errors[0])
        return out

    async def _get_chunk(
        self, url: str, keys: list[str], idx: list[int], out: list[bytes | None], deadline: float
    ) -> None:
        """One batch get; a retry after a cut stream asks only for the keys not yet received."""
        pending = list(idx)

        async def fn(s: aiohttp.ClientSession) -> None:
            nonlocal pending
            body = {"keys": [keys[i] for i in pending]}
            async with s.post("/v1/batch/get", json=body) as r:
                await _check(r, ok=(200,))
                if r.content_type != framing.CONTENT_TYPE:
                    raise ProtocolError(f"batch get answered {r.content_type}, not {framing.CONTENT_TYPE}")
                item_error: KVStoreClientError | None = None
                async for key, status, payload in framing.read_get_items(r.content):
                    if not pending or key != keys[pending[0]]:
                        raise ProtocolError(f"batch get answered key {key!r} out of order")
                    i = pending.pop(0)
                    if status == 200:
                        out[i] = payload
                    elif status != 404 and item_error is None:
                        item_error = _error_from(status, payload)
                if pending:
                    raise ProtocolError(f"batch get did not answer {len(pending)} keys")
                if item_error is not None and self.strict:
                    raise item_error

        await self._attempts(self._endpoints[url], fn, deadline)

    async def put_many(
        self,
        items: Iterable[tuple[str, framing.BufferLike]],
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[bool]:
        """Store many blocks with ``/v1/batch/put``; per item, whether it is
        stored. ``metas``: each item's engine identity (as ``put``), or None."""
        return [s is not None for s in await self.put_many_detail(items, metas)]

    async def put_many_detail(
        self,
        items: Iterable[tuple[str, framing.BufferLike]],
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[int | None]:
        """:meth:`put_many`, per item: 201 (this call stored it), 200 (it was
        stored already: first write wins), or None (failed)."""
        items = list(items)
        if metas is not None and len(metas) != len(items):
            raise ValueError(f"{len(items)} items but {len(metas)} metas")
        failed: list[int | None] = [None] * len(items)
        result = await self._guard("put_many", failed, self._put_many(items, metas))
        self.stats["puts"] += len(items)
        self.stats["put_failures"] += result.count(None)
        return result

    async def _put_many(
        self, items: list[tuple[str, framing.BufferLike]], metas: Sequence[Mapping[str, Any] | None] | None = None
    ) -> list[int | None]:
        for k, _ in items:
            framing.check_key(k)
        deadline = self._deadline()
        ok: list[int | None] = [None] * len(items)
        groups: dict[str, list[int]] = {}
        for i, (k, _) in enumerate(items):
            for url in self.owners(k):
                groups.setdefault(url, []).append(i)
        if self.transport == "nixl":
            for url in list(groups):
                if await self._nixl_write(url, items, groups[url], ok, metas):
                    del groups[url]
        calls = [
            self._put_chunk(url, items, idx[c : c + self.max_batch_keys], ok, deadline, metas)
            for url, idx in groups.items()
            for c in range(0, len(idx), self.max_batch_keys)
        ]
        errors = [r for r in await asyncio.gather(*calls, return_exceptions=True) if isinstance(r, BaseException)]
        for e in errors:
            if not isinstance(e, KVStoreClientError):
                raise e
        if errors and (self.strict or all(o is None for o in ok)):
            raise errors[0]
        return ok

    async def _put_chunk(
        self,
        url: str,
        items: list[tuple[str, framing.BufferLike]],
        idx: list[int],
        ok: list[int | None],
        deadline: float,
        metas: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> None:
        chosen = [metas[i] for i in idx] if metas is not None else None

        async def fn(s: aiohttp.ClientSession) -> None:
            body = _BuffersPayload(framing.encode_put_stream((items[i] for i in idx), chosen), framing.CONTENT_TYPE)
            async with s.post("/v1/batch/put", data=body) as r:
                if r.status in (200, 400, 413) and r.content_type == "application/json":
                    doc = await _json(r)
                    results = doc.get("results")
                    if isinstance(results, list):
                        for i, res in zip(idx, results, strict=False):
                            _stored(ok, i, res)
                        if r.status == 200:
                            return
                await _check(r, ok=())

        await self._attempts(self._endpoints[url], fn, deadline)


def _planned_miss(plan: Plan, key: str) -> bool:
    """Whether ``plan`` answers ``key`` absent (404)."""
    return plan.others.get(key, (0, ""))[0] == 404


def _stored(ok: list[int | None], i: int, res: Any) -> None:
    """Record item ``i``'s put result: 201 (stored now) over 200 (there
    already) over None (failed), across replicas."""
    if isinstance(res, dict) and res.get("status") in (200, 201):
        ok[i] = max(ok[i] or 0, int(res["status"]))


async def _json(r: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        doc = json.loads(await r.read())
    except ValueError as e:
        raise ProtocolError(f"bad JSON answer: {e}", status=r.status) from None
    if not isinstance(doc, dict):
        raise ProtocolError("JSON answer is not an object", status=r.status)
    return doc


def _error_from(status: int, body: bytes, r: aiohttp.ClientResponse | None = None) -> ServerError:
    code, message = f"http_{status}", (r.reason if r is not None and r.reason else "")
    try:
        doc = json.loads(body) if body else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error", doc)
        if isinstance(err, dict):
            code = str(err.get("code", code))
            message = str(err.get("message", message))
    return ServerError(
        message or f"HTTP {status}",
        status=status,
        code=code,
        retryable=status in RETRYABLE_STATUSES,
    )


async def _check(r: aiohttp.ClientResponse, ok: tuple[int, ...]) -> None:
    """Return if ``r.status`` is in ``ok``; raise _Miss on 404, else the server's error."""
    if r.status in ok:
        return
    if r.status == 404:
        raise _Miss
    body = await r.read() if r.method != "HEAD" else b""
    err = _error_from(r.status, body, r)
    err.breaker_failure = r.status in BREAKER_STATUSES
    raise err
