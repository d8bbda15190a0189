"""A client that pipelines requests and never reads its answers is read no
further than a bounded amount, on the fast lane and on aiohttp's path
(issue "one data plane", F1).

Used to be: while one of its GETs waited in the bulk queue, the fast lane
appended every byte the client sent to its buffer, with no bound and no
pause: 176 MB read in 22 s, the worker's memory from 85 to 441 MB, another
tenant's GETs slowed to seconds, and the worker stayed busy after SIGTERM.
aiohttp's own path answered every pipelined request of less than 64 KiB
into the transport's buffer without waiting for the client (60,000
answers, 180 MB of memory, in 8 s), so it never stopped reading either.
Now every request is parsed by aiohttp's parser, whose queue of 32 requests
stops reading the connection, and the next request waits until the client
takes what is buffered for it (connection.py, ``_taken``).

The test floods a real daemon (one worker, the lane on and off) on
127.0.0.1 and counts what the kernel lets the client send: once the daemon
stops reading, sends block after the sockets' buffers (a few MB on loopback)
fill.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request

import pytest

from tests.http.conftest import ADMIN, Daemon

FLOOD_LIMIT = 48 << 20  # far above loopback's socket buffers, far below what an unbounded reader takes
STALLED_S = 3.0  # sends blocked this long: the daemon stopped reading
MAX_S = 30.0


def _call(base: str, method: str, path: str, token: str, body: bytes | None = None) -> bytes:
    req = urllib.request.Request(base + path, data=body, method=method, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return bytes(r.read())


@pytest.mark.parametrize("lane", ["true", "false"])
@pytest.mark.parametrize("warm", [True, False])
def test_a_client_that_never_reads_is_not_read_without_bound(daemon: Daemon, lane: str, warm: bool) -> None:
    """``warm``: the block was read once before (its frames verified), so
    the lane answers its GETs; else the first goes to the route."""
    daemon.env["KVSTORE_FAST_LANE"] = lane
    daemon.start()
    tokens = {}
    for name in ("flooder", "other"):
        doc = _call(
            daemon.base, "POST", "/v1/admin/tenants", ADMIN, json.dumps({"name": name, "policy": "direct"}).encode()
        )
        tokens[name] = json.loads(doc)["token"]
    block = os.urandom(3000)
    _call(daemon.base, "PUT", "/v1/blocks/k", tokens["flooder"], block)
    _call(daemon.base, "PUT", "/v1/blocks/k", tokens["other"], block)
    if warm:
        assert _call(daemon.base, "GET", "/v1/blocks/k", tokens["flooder"]) == block
    request = f"GET /v1/blocks/k HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tokens['flooder']}\r\n\r\n".encode()
    chunk = request * 1000
    sent = 0
    with socket.create_connection(("127.0.0.1", daemon.port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
        s.setblocking(False)
        start = last_progress = time.monotonic()
        view = memoryview(chunk)
        while sent < FLOOD_LIMIT and time.monotonic() - start < MAX_S:
            try:
                n = s.send(view)
            except BlockingIOError:
                if time.monotonic() - last_progress > STALLED_S:
                    break
                time.sleep(0.01)
                continue
            sent += n
            last_progress = time.monotonic()
            view = view[n:] if n < len(view) else memoryview(chunk)
        stalled = time.monotonic() - last_progress > STALLED_S
        # Meanwhile another tenant is served (no timing asserted: a shared machine).
        assert _call(daemon.base, "GET", "/v1/blocks/k", tokens["other"]) == block
        assert stalled and sent < FLOOD_LIMIT, f"the daemon read {sent / 1e6:.0f} MB from a client that never read"
    # The worker is well after the client went away, and stops.
    assert _call(daemon.base, "GET", "/v1/blocks/k", tokens["other"]) == block
    assert daemon.stop() == 0


def _metric(base: str, name: str) -> float:
    """The sum of a counter's samples on /metrics."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_lane_answer_the_client_does_not_take_is_cut_off(daemon: Daemon) -> None:
    """F2: a GET the lane answers (a 32 MiB block, the client's receive buffer
    4 KiB, never read) is reset once ``request_timeout_s`` passes without a
    piece taken, as the route's answers are (docs/API.md). It used to stay
    open with its answer, the block's mapping and the transfer slot held:
    the client could still read every byte 20 s later."""
    daemon.env.update(KVSTORE_REQUEST_TIMEOUT_S="2", KVSTORE_MAX_BLOCK_SIZE="40MiB", KVSTORE_SEGMENT_SIZE="64MiB")
    daemon.start()
    doc = _call(daemon.base, "POST", "/v1/admin/tenants", ADMIN, json.dumps({"name": "t", "policy": "direct"}).encode())
    token = json.loads(doc)["token"]
    block = os.urandom(32 << 20)
    _call(daemon.base, "PUT", "/v1/blocks/big", token, block)
    assert _call(daemon.base, "GET", "/v1/blocks/big", token) == block  # its frames verified: the lane's from now on
    lane_before = _metric(daemon.base, 'kvstore_http_fast_lane_total{method="GET"}')
    cut_before = _metric(daemon.base, "kvstore_http_client_disconnects_total")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
        s.connect(("127.0.0.1", daemon.port))
        s.sendall(f"GET /v1/blocks/big HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
        deadline = time.monotonic() + 30
        while _metric(daemon.base, "kvstore_http_client_disconnects_total") <= cut_before:
            assert time.monotonic() < deadline, "the stalled answer was never cut off"
            time.sleep(0.2)
        assert _metric(daemon.base, 'kvstore_http_fast_lane_total{method="GET"}') == lane_before + 1
        received = 0
        s.settimeout(10)
        try:
            while chunk := s.recv(1 << 20):
                received += len(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    assert received < len(block), f"the whole answer ({received} bytes) was still there to read"
    assert _call(daemon.base, "GET", "/v1/blocks/big", token) == block  # and the worker serves on
    assert daemon.stop() == 0
