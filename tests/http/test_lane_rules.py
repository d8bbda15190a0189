"""The fast lane and the route follow the same HTTP rules (issue "one data
plane", F3-F6): the same bytes sent to a daemon with the lane and to one
without it (``fast_lane = false``) get the same answers, in the same order,
and leave the same blocks stored.

Used to differ:

- F3: a ``Content-Encoding: gzip`` PUT was stored compressed by the lane and
  decoded by aiohttp; a lookup with ``Content-Encoding: br`` and a plain
  body was 200 on the lane, 400 on the route. Now a body in a content
  coding is refused everywhere: ``415 unsupported_media_type``.
- F4: aiohttp's limit of header fields (431) and its refusal of a hixie-76
  WebSocket handshake (``Sec-WebSocket-Key1``) were skipped for requests the
  lane answered.
- F5: a valid PUT followed by garbage in the same read was stored by the
  lane, then answered 400; aiohttp runs nothing of such a read. A hot GET
  with ``Connection: close`` followed by more bytes: lane 200, aiohttp 400.
- F6: pipelined GETs then ``shutdown(SHUT_WR)``: aiohttp answered the
  first and dropped the rest; the lane as many as the timing allowed. Now
  every request sent before the half-close is answered, in order, on both
  paths, then the connection closes.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.http.conftest import ADMIN, Daemon, daemon_env, free_port

KEY = "k"
BLOCK = b"block bytes " * 100


def _call(base: str, method: str, path: str, token: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path, data=body, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, bytes(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Node:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        status, doc = _call(
            daemon.base, "POST", "/v1/admin/tenants", ADMIN, json.dumps({"name": "t", "policy": "direct"}).encode()
        )
        assert status == 201, doc
        self.token = json.loads(doc)["token"]
        assert _call(daemon.base, "PUT", f"/v1/blocks/{KEY}", self.token, BLOCK)[0] == 201
        assert _call(daemon.base, "GET", f"/v1/blocks/{KEY}", self.token) == (200, BLOCK)  # verified: lane-ready

    def exchange(self, raw: bytes, half_close: bool, expect: int) -> list[tuple[int, str | None]]:
        """Send ``raw`` in one write, then read the answers until the daemon
        closes, or ``expect`` of them and then a short quiet (for answers
        beyond those): their (status, error code) in order."""
        with socket.create_connection(("127.0.0.1", self.daemon.port)) as s:
            s.sendall(raw)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            s.settimeout(30)
            data = b""
            try:
                while chunk := s.recv(1 << 16):
                    data += chunk
                    if len(_answers(data)) >= expect:
                        s.settimeout(0.3)
            except (TimeoutError, ConnectionResetError):
                pass
        return _answers(data)

    def stored(self, key: str) -> int:
        return _call(self.daemon.base, "GET", f"/v1/blocks/{key}", self.token)[0]


def _answers(data: bytes) -> list[tuple[int, str | None]]:
    """The complete answers at the start of ``data`` (none is to a HEAD)."""
    out = []
    while (end := data.find(b"\r\n\r\n")) > 0:
        head = data[:end].decode("latin-1")
        status = int(head.split(" ", 2)[1])
        m = re.search(r"(?im)^content-length:\s*(\d+)", head)
        length = int(m.group(1)) if m else 0
        if len(data) < end + 4 + length:
            break
        body = data[end + 4 : end + 4 + length]
        data = data[end + 4 + length :]
        code = None
        if body.startswith(b"{"):
            code = json.loads(body).get("error", {}).get("code")
        out.append((status, code))
    return out


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    daemons = {}
    try:
        for lane in ("true", "false"):
            where: Path = tmp_path_factory.mktemp(f"lane-{lane}")
            env = daemon_env(where, fast_lane=lane, segment_size="1MiB", frame_size="64KiB")
            d = daemons[lane] = Daemon(where / "data", free_port(), env)
            d.start()
        yield {"lane": Node(daemons["true"]), "route": Node(daemons["false"])}
    finally:
        for d in daemons.values():
            if d.proc is not None:
                d.stop()


def _request(node: Node, method: str, path: str, *lines: str, body: bytes = b"", auth: bool = True) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: x"]
    if auth:
        head.append(f"Authorization: Bearer {node.token}")
    if body or method in ("PUT", "POST"):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join([*head, *lines]) + "\r\n\r\n").encode() + body


def _same(
    nodes: dict[str, Node], make: Callable[[Node], bytes], expect: int = 1, half_close: bool = False
) -> list[tuple[int, str | None]]:
    """Both daemons' answers to the bytes ``make(node)`` builds (``expect``
    of them, or more); asserted equal."""
    got = {name: node.exchange(make(node), half_close, expect) for name, node in nodes.items()}
    assert got["lane"] == got["route"], got
    return got["lane"]


def _put(node: Node, key: str, coding: str, body: bytes) -> bytes:
    return _request(node, "PUT", f"/v1/blocks/{key}", f"Content-Encoding: {coding}", body=body)


def _lookup(node: Node, coding: str) -> bytes:
    body = json.dumps({"keys": [KEY]}).encode()
    return _request(
        node, "POST", "/v1/lookup", "Content-Type: application/json", f"Content-Encoding: {coding}", body=body
    )


def test_a_body_in_a_content_coding_is_refused_on_every_path(nodes: dict[str, Node]) -> None:
    data = b"compressed by the client " * 50
    for coding, body in (("gzip", gzip.compress(data)), ("br", data), ("zstd", data), ("GZIP", gzip.compress(data))):
        assert _same(nodes, partial(_put, key=f"enc-{coding}", coding=coding, body=body)) == [
            (415, "unsupported_media_type")
        ]
        assert all(node.stored(f"enc-{coding}") == 404 for node in nodes.values())
        assert _same(nodes, partial(_lookup, coding=coding)) == [(415, "unsupported_media_type")]
    # identity is no coding; and a GET (no body) with the header is served as before
    assert _same(nodes, partial(_put, key="ident", coding="identity", body=data)) == [(201, None)]
    assert _same(nodes, lambda n: _request(n, "GET", f"/v1/blocks/{KEY}", "Content-Encoding: gzip")) == [(200, None)]


def test_the_parser_limits_hold_for_hot_requests(nodes: dict[str, Node]) -> None:
    many = [f"X-Field-{i}: v" for i in range(130)]
    answers = _same(nodes, lambda n: _request(n, "GET", f"/v1/blocks/{KEY}", *many))
    assert answers == [(431, "headers_too_large")]
    answers = _same(nodes, lambda n: _request(n, "GET", f"/v1/blocks/{KEY}", *many[:100]))
    assert answers == [(200, None)]  # under aiohttp's 128: served, on the route
    answers = _same(
        nodes, lambda n: _request(n, "GET", f"/v1/blocks/{KEY}", "Sec-WebSocket-Key1: 4 @1  46546xW%0l 1 5")
    )
    assert answers[0][0] == 400


def test_a_read_the_parser_refuses_runs_nothing(nodes: dict[str, Node]) -> None:
    answers = _same(
        nodes, lambda n: _request(n, "PUT", "/v1/blocks/then-garbage", body=b"x" * 100) + b"\x00\x01garbage\r\n\r\n"
    )
    assert answers == [(400, "bad_request")]
    assert all(node.stored("then-garbage") == 404 for node in nodes.values())
    answers = _same(
        nodes,
        lambda n: (
            _request(n, "GET", f"/v1/blocks/{KEY}", "Connection: close") + _request(n, "GET", f"/v1/blocks/{KEY}")
        ),
    )
    assert answers == [(400, "bad_request")]
    # Pipelined requests that all parse: every one answered, in order.
    answers = _same(
        nodes,
        lambda n: (
            _request(n, "GET", f"/v1/blocks/{KEY}")
            + _request(n, "GET", "/v1/blocks/missing")
            + _request(n, "GET", f"/v1/blocks/{KEY}")
        ),
        3,
    )
    assert [status for status, _ in answers] == [200, 404, 200]


def test_a_half_close_after_pipelined_requests_answers_them_all(nodes: dict[str, Node]) -> None:
    for _ in range(10):
        answers = _same(nodes, lambda n: _request(n, "GET", f"/v1/blocks/{KEY}") * 5, 5, half_close=True)
        assert answers == [(200, None)] * 5
    mixed = _same(
        nodes,
        lambda n: (
            _request(n, "GET", "/v1/blocks/missing")
            + _request(n, "PUT", "/v1/blocks/late", body=b"y" * 10)
            + _request(n, "GET", f"/v1/blocks/{KEY}")
        ),
        half_close=True,
    )
    assert [status for status, _ in mixed] == [404, 201, 200]
