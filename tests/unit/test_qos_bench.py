"""kvstore-bench qos's pure parts: Retry-After, percentiles, medians,
targets, and its HTTP/1.1 connection's parsing of answers (fed by hand, no
network)."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from typing import Any

import pytest
from kvstore_bench import qos_bench as q
from kvstore_bench.cli import build_parser


def test_retry_after() -> None:
    assert q.parse_retry_after(None) == q.RETRY_AFTER_DEFAULT_S
    assert q.parse_retry_after("2") == 2.0
    assert q.parse_retry_after(" 3 ") == 3.0
    assert q.parse_retry_after("0") == 0.0
    assert q.parse_retry_after("0.25") == 0.25
    assert q.parse_retry_after("99999") == q.RETRY_AFTER_MAX_S
    for bad in ("", "soon", "-1", "nan", "Wed, 21 Oct 2015 07:28:00 GMT"):
        assert q.parse_retry_after(bad, default=1.5) == 1.5, bad


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(100, 0, -1)]  # 1..100, unsorted
    assert q.percentile(xs, 0.5) == 50.0
    assert q.percentile(xs, 0.99) == 99.0
    assert q.percentile(xs, 1.0) == 100.0
    assert q.percentile([7.0], 0.99) == 7.0
    assert q.percentile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert math.isnan(q.percentile([], 0.5))


def test_medians_leave_out_nan_and_missing() -> None:
    rounds = [{"a": 1.0, "b": float("nan")}, {"a": 3.0, "b": 4.0}, {"a": 2.0, "c": 5.0}]
    med = q.medians(rounds)
    assert med["a"] == 2.0 and med["b"] == 4.0 and med["c"] == 5.0
    assert math.isnan(q.medians([{"x": float("nan")}])["x"])


def test_weights_argument() -> None:
    assert q.parse_weights("300,100") == (300, 100)
    assert q.parse_weights("100,100") == (100, 100)
    for bad in ("300", "100,300", "0,0", "1001,1", "a,b", "300,100,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            q.parse_weights(bad)


def test_targets() -> None:
    med = {"limit_get_mbps": 54.9, "limit_put_mbps": 55.2, "flood_p99_ratio": 1.5, "weights_ratio": 2.6}
    tg = q.targets(med, 50_000_000, (300, 100))
    assert tg["limit_get_mbps"]["met"] is True
    assert tg["limit_put_mbps"]["met"] is False
    assert tg["flood_p99_ratio"]["met"] is True
    assert tg["weights_ratio"]["met"] is False  # 2.6 is 13% under 3.0
    assert q.targets({"weights_ratio": 2.75}, 50_000_000, (300, 100))["weights_ratio"]["met"] is True
    unmeasured = q.targets({"limit_get_mbps": float("nan")}, 50_000_000, (300, 100))
    assert all(t["met"] is None and t["value"] is None for t in unmeasured.values())


def test_metrics_per_tenant() -> None:
    text = (
        "# TYPE kvstore_tenant_throttled_seconds_total counter\n"
        'kvstore_tenant_throttled_seconds_total{tenant="a"} 1.5\n'
        'kvstore_tenant_throttled_seconds_total{worker="1",tenant="b"} 2\n'
        'kvstore_tenant_throttled_seconds_total{worker="2",tenant="b"} 0.25\n'
        'kvstore_tenant_rate_limited_total{tenant="a"} 7\n'
        'kvstore_tenant_throttled_seconds_total_x{tenant="c"} 9\n'
    )
    assert q.parse_metrics(text, "kvstore_tenant_throttled_seconds_total") == {"a": 1.5, "b": 2.25}
    assert q.parse_metrics(text, "kvstore_tenant_rate_limited_total") == {"a": 7.0}
    assert q.parse_metrics("", "kvstore_tenant_rate_limited_total") == {}


def test_heads() -> None:
    status, headers = q.parse_head(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2")
    assert status == 429 and headers == {"retry-after": "1", "content-length": "2"}
    with pytest.raises(ConnectionError):
        q.parse_head(b"SSH-2.0-OpenSSH\r\n")
    head = q.request_head("PUT", "/v1/blocks/k", "127.0.0.1:1", "tok", 10)
    assert head.startswith(b"PUT /v1/blocks/k HTTP/1.1\r\n") and head.endswith(b"\r\n\r\n")
    assert b"Content-Length: 10\r\n" in head and b"Authorization: Bearer tok\r\n" in head
    assert b"Content-Length" not in q.request_head("GET", "/v1/blocks/k", "h", "tok", None)


def test_cli_knows_qos() -> None:
    parser, _ = build_parser()
    choices = next(a.choices for a in parser._actions if a.dest == "command")
    assert choices is not None and "qos" in choices
    args = q.build_parser().parse_args(["--duration", "2", "--repeats", "1", "--size", "1MiB", "--phases", "flood"])
    assert args.duration == 2.0 and args.repeats == 1 and args.size == 1 << 20 and args.phases == ["flood"]


# -- the connection, fed by hand ---------------------------------------------------------------


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.pending = 0
        self.closed = False

    def writelines(self, data: list[bytes]) -> None:
        self.sent += data

    def get_write_buffer_size(self) -> int:
        return self.pending

    def close(self) -> None:
        self.closed = True


def feed(conn: q.HttpConn, data: bytes, chunk: int) -> None:
    while data:
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(data), chunk)
        buf[:n] = data[:n]
        conn.buffer_updated(n)
        data = data[n:]


def exchange(answer: bytes, chunk: int, bufsize: int = 4096, **conn_kw: Any) -> tuple[q.Answer, q.HttpConn]:
    async def go() -> tuple[q.Answer, q.HttpConn]:
        conn = q.HttpConn(bufsize=bufsize, **conn_kw)
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        fut = conn.request(b"GET / HTTP/1.1\r\n\r\n")
        feed(conn, answer, chunk)
        return await asyncio.wait_for(fut, 1), conn

    return asyncio.run(go())


@pytest.mark.parametrize("chunk", [1, 7, 100, 4096])
def test_connection_counts_a_large_body(chunk: int) -> None:
    body = bytes(range(256)) * 400  # 102,400 bytes: over KEEP_BODY, so only counted
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: x\r\n\r\n" % len(body) + body
    now = time.monotonic()
    answer, conn = exchange(raw, chunk, window=(now - 10, now + 60))
    assert answer.status == 200 and answer.nbytes == len(body) and answer.body == b"" and answer.reusable
    assert conn.window_bytes == len(body)


@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_connection_keeps_a_short_body_and_its_headers(chunk: int) -> None:
    body = b'{"error": {"code": "rate_limited", "message": "over"}}'
    raw = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    answer, conn = exchange(raw, chunk)
    assert answer.status == 429 and answer.body == body and answer.headers["retry-after"] == "2"
    assert q.parse_retry_after(answer.headers.get("retry-after")) == 2.0
    assert conn.window_bytes == 0  # no window


def test_connection_close_and_empty_bodies() -> None:
    answer, _ = exchange(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n", 4096)
    assert answer.status == 204 and answer.nbytes == 0 and not answer.reusable
    answer, _ = exchange(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n", 3)
    assert answer.status == 201 and answer.reusable


def test_connection_refuses_what_it_cannot_read() -> None:
    for raw in (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabc",  # past the length
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    ):
        with pytest.raises(ConnectionError):
            exchange(raw, 4096)


def test_an_early_answer_is_not_reused() -> None:
    async def go() -> q.Answer:
        conn = q.HttpConn(bufsize=4096)
        transport = FakeTransport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        fut = conn.request(b"PUT /v1/blocks/k HTTP/1.1\r\nContent-Length: 9\r\n\r\n", b"x" * 9)
        transport.pending = 5  # part of the body not sent yet
        feed(conn, b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\n\r\n", 4096)
        return await asyncio.wait_for(fut, 1)

    answer = asyncio.run(go())
    assert answer.status == 429 and not answer.reusable


def test_a_lost_connection_fails_the_request() -> None:
    async def go() -> None:
        conn = q.HttpConn(bufsize=4096)
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        fut = conn.request(b"GET / HTTP/1.1\r\n\r\n")
        feed(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", 4096)
        conn.connection_lost(None)
        with pytest.raises(ConnectionError):
            await fut
        with pytest.raises(ConnectionError):
            conn.request(b"GET / HTTP/1.1\r\n\r\n")

    asyncio.run(go())
