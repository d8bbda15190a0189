"""Fail-open: dead, failing and silent servers give misses within the deadline, never exceptions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from conftest import Daemon, free_port
from kvstore_client import AsyncClient, CircuitBreaker, DeadlineExceeded, ServerError


async def test_daemon_stopped_mid_run(daemon: Daemon) -> None:
    async with AsyncClient(daemon.url, daemon.token, timeout=1.0, retries=2) as c:
        assert await c.put("k", b"block")
        assert await c.get("k") == b"block"
        daemon.stop()
        t0 = time.monotonic()
        assert await c.get("k") is None
        assert await c.get_into("k", bytearray(10)) is None
        assert await c.get_range("k", 0, 2) is None
        assert await c.exists("k") is False
        assert await c.lookup(["k"]) == 0
        assert await c.lookup_detail(["k", "j"]) == [False, False]
        assert await c.get_many(["k", "j"]) == [None, None]
        assert await c.put("k2", b"x") is False
        assert await c.put_many([("k3", b"x")]) == [False]
        assert await c.delete("k") is False
        assert time.monotonic() - t0 < 10 * 1.0
        assert c.stats["errors"] == 10
        assert c.stats["breaker_trips"] == 1  # 5 consecutive failures opened it
        assert c.stats["breaker_open"] >= 1


async def _serve(handler: Callable[[web.Request], web.StreamResponse]) -> AsyncIterator[tuple[str, list[str]]]:
    seen: list[str] = []

    async def h(request: web.Request) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path}")
        await request.read()
        return handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", h)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


def _error(status: int, code: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": f"test {code}"}}, status=status)


@pytest.fixture
async def server_500() -> AsyncIterator[tuple[str, list[str]]]:
    async for s in _serve(lambda r: _error(500, "corruption")):
        yield s


@pytest.fixture
async def server_503() -> AsyncIterator[tuple[str, list[str]]]:
    async for s in _serve(lambda r: _error(503, "overloaded")):
        yield s


async def test_500_is_not_retried(server_500: tuple[str, list[str]]) -> None:
    url, seen = server_500
    async with AsyncClient(url, "t", timeout=2, retries=3) as c:
        assert await c.get("k") is None
        assert seen == ["GET /v1/records/k"]  # loopback: decode="auto" reads the record as stored
        assert await c.put("k", b"x") is False
        assert await c.lookup(["a", "b"]) == 0
        assert c.stats["retries"] == 0 and c.stats["errors"] == 3
        assert c.breaker_state(url) == "closed"  # a 500 is about a block, not a dead server
    async with AsyncClient(url, "t", timeout=2, strict=True) as c:
        with pytest.raises(ServerError) as e:
            await c.get("k")
        assert (e.value.status, e.value.code, e.value.message) == (500, "corruption", "test corruption")


async def test_503_is_retried_then_a_miss(server_503: tuple[str, list[str]]) -> None:
    url, seen = server_503
    async with AsyncClient(url, "t", timeout=2, retries=2, backoff=0.01) as c:
        t0 = time.monotonic()
        assert await c.get("k") is None
        assert time.monotonic() - t0 < 1
        assert seen == ["GET /v1/records/k"] * 3
        assert c.stats["retries"] == 2
        assert await c.exists("k") is False  # HEAD: no body, still a miss
    async with AsyncClient(url, "t", timeout=2, retries=0, strict=True) as c:
        with pytest.raises(ServerError) as e:
            await c.get_many(["a", "b"])
        assert (e.value.status, e.value.code) == (503, "overloaded")


async def test_silent_server_is_a_miss_within_the_deadline() -> None:
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with AsyncClient(url, "t", timeout=0.3, retries=2) as c:
            calls: list[tuple[Callable[[], Awaitable[object]], object]] = [
                (lambda: c.get("k"), None),
                (lambda: c.lookup(["a"]), 0),
                (lambda: c.get_many(["a"]), [None]),
                (lambda: c.put("k", b"x" * 1000), False),
            ]
            for call, miss in calls:
                t0 = time.monotonic()
                assert await call() == miss
                assert time.monotonic() - t0 < 0.3 + 0.25
            assert c.stats["timeouts"] == 4
        async with AsyncClient(url, "t", timeout=0.2, strict=True) as c:
            with pytest.raises(DeadlineExceeded):
                await c.get("k")
    finally:
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()


async def test_breaker_opens_then_closes_when_the_server_is_back(daemon: Daemon) -> None:
    cooldown = 3.0  # longer than a daemon restart on a busy machine
    async with AsyncClient(
        daemon.url, daemon.token, timeout=1, retries=0, breaker_threshold=2, breaker_cooldown=cooldown
    ) as c:
        assert await c.put("k", b"v")
        daemon.stop()
        assert await c.get("k") is None
        assert await c.get("k") is None
        opened = time.monotonic()
        assert c.breaker_state(daemon.url) == "open"
        for _ in range(100):
            assert await c.get("k") is None
        assert c.stats["breaker_open"] == 100  # each refused by the open breaker: not even sent
        daemon.start()
        if time.monotonic() - opened < cooldown - 0.5:
            assert await c.get("k") is None  # back, but still within the cooldown: not asked
            assert c.stats["breaker_open"] == 101
        await asyncio.sleep(max(0.0, opened + cooldown + 0.05 - time.monotonic()))
        assert await c.get("k") == b"v"  # the probe
        assert c.breaker_state(daemon.url) == "closed"
        assert await c.exists("k") is True


def test_breaker_state_machine() -> None:
    now = [0.0]
    b = CircuitBreaker(threshold=3, cooldown=10, clock=lambda: now[0])
    for _ in range(2):
        b.failure()
    b.success()  # resets the count
    for _ in range(2):
        b.failure()
    assert b.state == "closed" and b.allow()
    b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 10.0
    assert b.allow()  # the probe
    assert b.state == "half-open" and not b.allow()  # one at a time
    b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 20.0
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()
    now[0] = 30.0
    for _ in range(3):
        b.failure()
    now[0] = 40.0
    assert b.allow()
    now[0] = 50.0
    assert b.allow()  # a probe that never reported expires after the cooldown


def test_json_error_body_parsing() -> None:
    from kvstore_client.answers import error_from as _error_from

    e = _error_from(507, json.dumps({"error": {"code": "storage_full", "message": "disk"}}).encode())
    assert (e.status, e.code, e.message, e.retryable) == (507, "storage_full", "disk", True)
    assert _error_from(502, b"<html>").code == "http_502"


async def test_retry_after_is_honoured_and_a_pacing_server_is_not_a_failure() -> None:
    """A 429 (or 503 overloaded) with Retry-After is retried no sooner than
    it says; one past the call's deadline is not waited for (a miss at once);
    and such answers never open the endpoint's circuit breaker."""
    answers: list[web.Response] = []

    def handler(request: web.Request) -> web.StreamResponse:
        if answers:
            return answers.pop(0)
        return web.json_response({"prefix": 1, "present": [True]})

    def paced(status: int, code: str, seconds: int) -> web.Response:
        r = _error(status, code)
        r.headers["Retry-After"] = str(seconds)
        return r

    async for url, seen in _serve(handler):
        async with AsyncClient(url, "t", timeout=3, retries=3, backoff=0.01, breaker_threshold=2) as c:
            answers.append(paced(429, "rate_limited", 1))
            t0 = time.monotonic()
            assert await c.lookup(["a"]) == 1
            assert time.monotonic() - t0 >= 1.0  # not after the 10 ms backoff
            assert c.stats["retries"] == 1 and len(seen) == 2
            answers.append(paced(429, "rate_limited", 10))  # past the 3 s deadline
            t0 = time.monotonic()
            assert await c.lookup(["a"]) == 0  # a miss, at once
            assert time.monotonic() - t0 < 0.5 and len(seen) == 3  # not retried
            answers.extend(paced(503, "overloaded", 10) for _ in range(3))
            for _ in range(3):
                assert await c.lookup(["a"]) == 0
            assert c.breaker_state(url) == "closed" and c.stats["breaker_trips"] == 0
            assert await c.lookup(["a"]) == 1
        async with AsyncClient(url, "t", timeout=3, retries=0, strict=True) as c:
            answers.append(paced(429, "rate_limited", 7))
            with pytest.raises(ServerError) as e:
                await c.lookup(["a"])
            assert (e.value.status, e.value.code, e.value.retry_after) == (429, "rate_limited", 7.0)
