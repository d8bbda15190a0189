"""One call's exchange with the daemons: sessions, retries, circuit breakers, the deadline.

Contract: every call has a deadline (``timeout`` seconds, retries included).
Retryable failures (connection errors, 429, 502, 503, 504, 507) are retried
with exponential backoff and full jitter while the deadline allows, never
sooner than an answer's ``Retry-After`` (and not at all when that is past
the deadline: the error is raised at once). Each
endpoint has a circuit breaker: after ``breaker_threshold`` consecutive
failures (connection errors, timeouts, 502/503/504 without a Retry-After) it opens and calls to that
endpoint return at once; after ``breaker_cooldown`` seconds one probe is let
through, and its success closes the breaker again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp

from kvstore_client.answers import Miss
from kvstore_client.breaker import CircuitBreaker
from kvstore_client.errors import CircuitOpenError, DeadlineExceeded, KVStoreClientError, UnavailableError
from kvstore_client.plans import PlanConnection
from kvstore_client.sharding import UNIX

log = logging.getLogger("kvstore_client")

T = TypeVar("T")
Call = Callable[[aiohttp.ClientSession], Awaitable[T]]

STAT_NAMES = (
    "plan_reads",  # get_into answered by a read plan (the segment file, no HTTP body; a miss included)
    "plan_fallbacks",  # get_into or put_many items that fell back to HTTP (sealed, object tier only, plan failed)
    "plan_writes",  # blocks put_many wrote through a write plan (into the segment file, no HTTP body)
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
    "puts_not_admitted",  # blocks its tenant's admission (admit_after) declined: not stored, not failures
)


@dataclass
class Endpoint:
    """One daemon, and what this client learned about it."""

    url: str
    breaker: CircuitBreaker
    token: str | None
    session: aiohttp.ClientSession | None = None
    plans: PlanConnection | None = None  # unix: endpoints, read plans
    paths_offered: bool = True  # http(s) endpoints: False once the daemon answered paths_not_offered
    client_decode: bool = False  # read records as stored and decode them here
    nixl: bool = True  # transport="nixl": False once the daemon answered nixl_disabled


@dataclass
class RateLimitedLog:
    """Warnings, at most one line per ``interval`` seconds (the rest counted)."""

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


class Exchange:
    """The endpoints, their sessions and breakers, and the retry loop every call goes through."""

    def __init__(
        self,
        endpoints: dict[str, Endpoint],
        *,
        timeout: float,
        retries: int,
        backoff: float,
        backoff_max: float,
        pool_size: int,
        ssl_context: ssl.SSLContext | None,
        log_interval: float,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.pool_size = pool_size
        self._ssl = ssl_context
        self.log = RateLimitedLog(log_interval)
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self.closed = False

    def session(self, ep: Endpoint) -> aiohttp.ClientSession:
        """``ep``'s HTTP session, made on first use (KVStoreClientError once closed)."""
        if self.closed:
            raise KVStoreClientError("the client is closed", code="closed")
        if ep.session is None or ep.session.closed:
            headers = {"Authorization": f"Bearer {ep.token}"} if ep.token else {}
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

    async def close(self) -> None:
        """Close every session and read-plan connection; later calls raise."""
        self.closed = True
        for ep in self.endpoints.values():
            if ep.session is not None:
                await ep.session.close()
                ep.session = None
            if ep.plans is not None:
                ep.plans.close()
                ep.plans = None

    def deadline(self) -> float:
        """A new call's deadline on the event loop's clock."""
        return asyncio.get_running_loop().time() + self.timeout

    async def attempts(self, ep: Endpoint, fn: Call[T], deadline: float) -> T:
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
                    result = await fn(self.session(ep))
            except Miss:
                ep.breaker.success()
                raise
            except TimeoutError:
                self.breaker_failure(ep)
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
                self.breaker_failure(ep)
            else:
                ep.breaker.success()
            if not err.retryable or attempt >= self.retries:
                raise err
            delay = random.uniform(0, min(self.backoff_max, self.backoff * 2**attempt))
            if err.retry_after is not None:  # the server's pace (429, 503 overloaded): never sooner
                delay = max(delay, err.retry_after)
            if loop.time() + delay >= deadline:
                raise err
            self.stats["retries"] += 1
            await asyncio.sleep(delay)
            attempt += 1

    def breaker_failure(self, ep: Endpoint) -> None:
        before = ep.breaker.state
        ep.breaker.failure()
        if ep.breaker.state == "open" and before != "open":
            self.stats["breaker_trips"] += 1
            self.log.warning("kvstore endpoint %s: circuit breaker opened", ep.url)

    async def on_owners(self, owners: list[str], fn: Call[T], deadline: float) -> T | None:
        """Try ``owners`` in order until one has the key; None if the ones that
        answered do not have it; raises the last error if none answered."""
        last: KVStoreClientError | None = None
        missed = False
        for url in owners:
            try:
                return await self.attempts(self.endpoints[url], fn, deadline)
            except Miss:
                missed = True
            except DeadlineExceeded:
                raise
            except KVStoreClientError as e:
                last = e
        if missed or last is None:
            return None
        raise last

    async def on_all_owners(self, urls: list[str], fn: Call[bool], deadline: float) -> bool:
        """``fn`` on every endpoint in ``urls`` at once; True if any returned True;
        raises the first error if all failed."""
        results = await asyncio.gather(
            *(self.attempts(self.endpoints[u], fn, deadline) for u in urls), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, Miss)]
        if any(r is True for r in results):
            return True
        if errors and len(errors) == len(results):
            raise errors[0]
        return False

    async def request(self, ep: Endpoint, what: str, call: Awaitable[T]) -> T:
        """One request to ``ep`` outside the retry loop (read plans with
        paths, their release): the timeout applies, no retries, no breaker."""
        try:
            async with asyncio.timeout(self.timeout):
                return await call
        except TimeoutError:
            raise DeadlineExceeded(f"no {what} within {self.timeout} s", endpoint=ep.url) from None
        except (aiohttp.ClientError, OSError) as e:
            raise UnavailableError(f"{type(e).__name__}: {e}", endpoint=ep.url) from None
