"""Raw-socket fuzzing: garbage request lines, headers, bodies and framing, and
slow clients (stalled headers and bodies, idle connections, disconnects
mid-response), on one worker and on ``--workers 2``.

Every garbage request must be answered (or the connection closed) promptly,
in HTTP/1.0 or 1.1, never with a 5xx but ``503 overloaded`` and ``505`` for
another HTTP version (never served), always with a JSON error body for an
error, and never echo a token; slow clients must not stop well-behaved
ones from being served, and must be cut off by the server's timeouts. Then
:meth:`Target.check` (canaries, isolation, logs, memory).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import time

from hypothesis import strategies as st
from kvstore_client.wire import batchframe

from tests.fuzz.client import Answer, exchange
from tests.fuzz.conftest import SETTINGS, Target, fuzz
from tests.http.conftest import ADMIN
from tests.http.rawhttp import Conn

REQUEST_TIMEOUT_S = float(SETTINGS["request_timeout_s"])
KEEPALIVE_TIMEOUT_S = float(SETTINGS["keepalive_timeout_s"])

METHODS = [b"GET", b"PUT", b"POST", b"DELETE", b"HEAD", b"PATCH", b"OPTIONS", b"TRACE", b"CONNECT", b"G@T", b""]
PATHS = [
    b"/v1/blocks/k",
    b"/v1/blocks/canary.a0",
    b"/v1/lookup",
    b"/v1/batch/put",
    b"/v1/batch/get",
    b"/v1/stats",
    b"/v1/admin/tenants",
    b"/v1/admin/tenants/canary-a",
    b"/v1/admin/flush",
    b"/healthz",
    b"/readyz",
    b"/metrics",
    b"*",
    b"http://x/v1/stats",
    b"/v1/blocks/%2e%2e%2f%2e%2e%2fv1%2fadmin",
    b"/v1/blocks/" + b"k" * 300,
]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"HTTP/9.9", b"http/1.1", b""]
TEXT = st.binary(max_size=64)


def header_lines(tokens: list[str]) -> st.SearchStrategy[list[bytes]]:
    auth = st.sampled_from([f"Bearer {t}".encode() for t in tokens]) | st.binary(max_size=40).map(
        lambda b: b"Bearer " + b
    )
    meaningful = st.one_of(
        auth.map(lambda v: b"Authorization: " + v),
        st.sampled_from([b"0", b"1", b"-1", b"abc", b"99999999999999999999", b" 5", b"1,1", b""]).map(
            lambda v: b"Content-Length: " + v
        ),
        st.sampled_from([b"chunked", b"gzip", b"chunked, gzip", b"gzip, chunked", b"identity", b"xchunked"]).map(
            lambda v: b"Transfer-Encoding: " + v
        ),
        st.sampled_from([b"application/json", b"application/json; charset=bogus", b"application/x-kvstore-batch"]).map(
            lambda v: b"Content-Type: " + v
        ),
        st.sampled_from([b"gzip", b"deflate", b"br", b"zstd"]).map(lambda v: b"Content-Encoding: " + v),
        st.sampled_from([b"bytes=0-0", b"bytes=-1", b"bytes=a-b", b"bytes=0-1,2-3"]).map(lambda v: b"Range: " + v),
        st.sampled_from([b"close", b"keep-alive", b"upgrade"]).map(lambda v: b"Connection: " + v),
        st.sampled_from([b"100-continue", b"nonsense"]).map(lambda v: b"Expect: " + v),
        st.just(b"Upgrade: websocket"),
        st.tuples(TEXT, TEXT).map(lambda nv: nv[0] + b": " + nv[1]),
        st.integers(8000, 9000).map(lambda n: b"X-Big: " + b"a" * n),
    )
    return st.lists(meaningful, max_size=8)


def body() -> st.SearchStrategy[bytes]:
    chunk = st.binary(max_size=200)
    chunked = st.lists(st.tuples(chunk, st.sampled_from([b"", b";ext=1", b"zz"])), max_size=4).map(
        lambda cs: b"".join(b"%x%s\r\n%s\r\n" % (len(c), ext, c) for c, ext in cs) + b"0\r\n\r\n"
    )
    batch = st.lists(st.tuples(st.sampled_from(["a", "b", "k.1"]), st.binary(min_size=1, max_size=100)), max_size=3)
    return st.one_of(
        st.just(b""),
        st.binary(max_size=2000),
        chunked,
        batch.map(batchframe.encode_put_stream),
        st.just(b'{"keys": ["canary.a0", "canary.b0"]}'),
        st.just(b"[" * 5000),
    )


@st.composite
def garbage(draw: st.DrawFn, tokens: list[str]) -> tuple[bytes, bool]:
    """A raw request (maybe several, pipelined) and whether to half-close after it."""
    eol = draw(st.sampled_from([b"\r\n"] * 8 + [b"\n", b"\r", b"\r\r\n"]))
    method = draw(st.sampled_from(METHODS) | TEXT.filter(lambda b: b" " not in b))
    path = draw(st.sampled_from(PATHS) | TEXT)
    version = draw(st.sampled_from(VERSIONS))
    line = draw(st.sampled_from([b" ".join((method, path, version)), method + b"  " + path + b" " + version]) | TEXT)
    host = draw(st.sampled_from([[b"Host: 127.0.0.1"], [], [b"Host: a", b"Host: b"]]))
    lines = [line, *host, *draw(header_lines(tokens))]
    raw = eol.join(lines) + eol + eol + draw(body())
    if draw(st.booleans()):
        raw += b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"  # pipelined after it
    return raw, draw(st.booleans())


def check_answer(target: Target, answer: Answer | None, answered_in_time: bool, raw: bytes) -> None:
    assert answered_in_time, f"no answer and no close within the timeout: {raw[:200]!r}"
    if answer is None:
        return  # closed: nothing complete to answer, or a cut-off body
    assert answer.status < 500 or answer.code in ("overloaded", "http_version_not_supported"), (
        answer.status,
        answer.body[:200],
        raw[:200],
    )
    version = raw.split(b"\n", 1)[0].rstrip(b"\r").rpartition(b" ")[2]
    if version.startswith(b"HTTP/") and version not in (b"HTTP/1.1", b"HTTP/1.0"):
        assert not 200 <= answer.status < 300, ("served in another HTTP version", answer.status, raw[:200])
    if answer.status >= 400 and not raw.startswith(b"HEAD "):
        assert answer.content_type.startswith("application/json"), (answer.status, answer.headers, raw[:200])
        assert answer.code is not None and json.loads(answer.body)["error"]["message"], answer.body[:200]
    text = answer.body.decode("latin-1")
    for secret in target.secrets:
        assert secret not in text, "a secret was echoed"


def test_raw_garbage(target: Target) -> None:
    tokens = [*target.tokens.values(), ADMIN]

    def one(case: tuple[bytes, bool]) -> None:
        raw, half_close = case
        answer, in_time = exchange(target.port, raw, half_close, timeout=REQUEST_TIMEOUT_S + KEEPALIVE_TIMEOUT_S + 10)
        check_answer(target, answer, in_time, raw)

    fuzz(one, examples=600, case=garbage(tokens))
    target.check()


async def _inflight_zero(target: Target, deadline: float) -> None:
    for role in target.roles:
        while True:
            text = target.worker(role).request("GET", "/metrics").body.decode()
            if "kvstore_http_inflight 0" in text and "kvstore_http_buffered_body_bytes 0" in text:
                break
            assert time.monotonic() < deadline, f"{role}: requests still in flight: {text[-600:]}"
            await asyncio.sleep(0.2)


async def test_slow_and_vanishing_clients(target: Target) -> None:
    """Stalled headers, stalled bodies (block, JSON and batch), idle
    keep-alives and clients that vanish mid-response, 20 of each at once:
    well-behaved requests are served meanwhile, every stalled request is cut
    off by the server (408, or the connection closed) within its timeouts,
    and nothing stays in flight or buffered."""
    token = target.tokens["canary-a"]
    auth = f"Authorization: Bearer {token}\r\n"
    big = "canary.a1"
    stalls = [
        b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n",  # headers that never end
        b"GE",
        (f"PUT /v1/blocks/slow HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 1000000\r\n\r\n").encode() + b"x" * 100,
        (f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 100\r\n\r\n").encode() + b'{"keys"',
        (f"POST /v1/batch/put HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 5000\r\n\r\n").encode()
        + batchframe.MAGIC
        + batchframe.put_item_header("s", 1000)
        + b"s" * 10,
        f"POST /v1/admin/tenants HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n".encode()
        + b"Content-Length: 50\r\n\r\n{",
        b"",  # connected, never a byte
    ]
    conns: list[Conn] = []
    for raw in stalls * 20:
        c = await Conn.open("127.0.0.1", target.port)
        if raw:
            await c.send(raw)
        conns.append(c)
    idle = []
    for _ in range(20):  # keep-alive connections idle after one request
        c = await Conn.open("127.0.0.1", target.port)
        assert (await c.request("GET", "/healthz")).status == 200
        idle.append(c)
    for _ in range(20):  # vanish mid-response: read a little, then reset
        c = await Conn.open("127.0.0.1", target.port)
        await c.send(f"GET /v1/blocks/{big} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        await c.reader.readexactly(1024)
        c.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.writer.transport.abort()
    # Well-behaved clients are served meanwhile, on every worker.
    data = target.canaries["canary-a"][big]
    for role in target.roles:
        for _ in range(5):
            r = target.worker(role).request("GET", f"/v1/blocks/{big}", {"Authorization": f"Bearer {token}"})
            assert r.status == 200 and r.body == data, role
    # Every stalled connection is answered 408 or closed by the server, within
    # its timeouts (plus aiohttp's 10 s lingering close after an unread body).
    bound = max(REQUEST_TIMEOUT_S, KEEPALIVE_TIMEOUT_S) + 10 + 10

    async def cut_off(c: Conn) -> bytes:
        out = b""
        while chunk := await c.reader.read(65536):
            out += chunk
        return out

    answers = await asyncio.wait_for(asyncio.gather(*(cut_off(c) for c in conns + idle)), bound)
    for raw, out in zip(stalls * 20 + [b"idle"] * 20, answers, strict=True):
        status = out.split(b" ", 2)[1] if out.startswith(b"HTTP/") else b""
        assert status in (b"", b"408", b"200"), (raw[:60], out[:200])
        if raw.startswith((b"PUT", b"POST")):
            assert status == b"408", (raw[:60], out[:200])
    for c in conns + idle:
        await c.close()
    await _inflight_zero(target, time.monotonic() + 30)
    target.check()


def test_disconnect_storm_leaves_no_trace(target: Target) -> None:
    """Hundreds of clients that reset the connection at every stage of a
    request (before the headers end, mid-body, mid-response): no error is
    logged, nothing is counted as internal, nothing stays in flight."""
    token = target.tokens["canary-b"]
    body = os.urandom(200_000)
    stages = [
        b"GET /v1/blocks/canary.b1 HTTP/1.1\r\nHost: x\r\nAuthoriz",
        f"PUT /v1/blocks/storm HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[:50_000],
        f"GET /v1/blocks/canary.b1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode(),
        f"POST /v1/batch/get HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n".encode()
        + b'Content-Length: 36\r\n\r\n{"keys": ["canary.b1", "canary.b1"]}',
    ]
    for i in range(200):
        with socket.create_connection(("127.0.0.1", target.port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stage = i % len(stages)
            s.sendall(stages[stage])
            if stage >= 2 and i % 3 == 0:
                s.recv(100)  # the answer has begun
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(1)  # let the server notice every reset before looking
    asyncio.run(_inflight_zero(target, time.monotonic() + 30))
    target.check()
