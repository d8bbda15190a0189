"""The daemon at its edges, on a real daemon of one or two worker processes:
unusual and malformed requests (deep nesting, Expect, HTTP versions, query
parameters, request line and header limits and timeouts, several ranges,
Last-Event-ID) get their documented answer on every worker, never a
traceback; a start-up that cannot go on ends in one line naming why; a
reader's relays to the writer are bounded and end with it.

Each test is named after the defect it pins; its docstring cites the item of
issue 24 ("Reliability II") that reported it."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from kvstore_client.wire import batchframe

from tests.http.conftest import ADMIN, ROOT, Daemon, free_port
from tests.http.rawhttp import Conn, Reply, worker_connections
from tests.http.test_hostile import _auth, _each_worker, _json_error, _raw, _start_two_workers

ADMIN_AUTH = f"Authorization: Bearer {ADMIN}"


def _metrics(reply: Reply) -> str:
    return reply.body.decode()


async def _quiet(daemon: Daemon) -> None:
    """Nothing was counted as an internal error, on any worker; then, once
    stopped, no ERROR line or traceback in the log."""
    for role, r in (await _each_worker(daemon.port, _raw("GET", "/metrics", []))).items():
        assert 'kvstore_errors_total{code="internal"}' not in _metrics(r), role
    daemon.stop()
    assert "Traceback" not in daemon.output and " ERROR " not in daemon.output, daemon.output[-3000:]


# -- deeply nested block identities and JSON bodies ----------------------------


async def test_nested_block_identity_answered_500_with_a_traceback(daemon: Daemon) -> None:
    """Item 4: Kvstore-Block-Meta of 5,000 '[' (or a KVB2 item's meta of
    60,000) raised RecursionError in events/model.py: 500, a traceback in the
    log per request, kvstore_errors_total{code="internal"}. extra_keys was
    stored at any depth (msgpack, for the ZMQ events, refuses 512 levels), and
    a JSON body nested 100 deep was accepted. Each is now 400 invalid_input,
    on every worker, and a shallow identity is still stored."""
    tokens = await _start_two_workers(daemon, log_level="debug")
    t1 = f"Authorization: Bearer {tokens['t1']}"

    def meta(doc: object | str) -> str:
        raw = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
        return "Kvstore-Block-Meta: " + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    deep_extra = {"block_hash": 1, "extra_keys": json.loads("[" * 40 + "]" * 40)}
    for header in (
        meta("[" * 5000),
        meta("{" * 3000),
        meta('{"block_hash": 1, "extra_keys": ' + "[" * 2500 + "1" + "]" * 2500 + "}"),
        meta(deep_extra),
        meta({"block_hash": json.loads("[" * 30 + "]" * 30)}),
    ):
        raw = _raw("PUT", "/v1/blocks/deep", [t1, header, "Content-Length: 4"], b"data")
        for role, r in (await _each_worker(daemon.port, raw)).items():
            err = _json_error(r)
            assert (r.status, err["code"]) == (400, "invalid_input"), (role, header[:60], r.status, err)
            assert "Kvstore-Block-Meta" in err["message"] and len(err["message"]) < 300, err
    # KVB2: the item is refused, the batch goes on.
    metas = [b"[" * 60_000, json.dumps(deep_extra).encode(), json.dumps({"block_hash": 7}).encode()]
    stream = batchframe.encode_put_stream([("n1", b"a"), ("n2", b"b"), ("n3", b"c")], metas)
    raw = _raw("POST", "/v1/batch/put", [t1, f"Content-Length: {len(stream)}"], stream)
    for role, r in (await _each_worker(daemon.port, raw)).items():
        results = r.json()["results"]
        assert [x["status"] for x in results][:2] == [400, 400], (role, results)
        assert results[2]["status"] in (200, 201), (role, results)
    # JSON bodies: 100 levels parse, but are refused (64 at most).
    for path, body, auth in (
        ("/v1/lookup", b'{"keys": [], "x": ' + b"[" * 100 + b"]" * 100 + b"}", t1),
        ("/v1/admin/tenants", b'{"name": "x", "policy": ' + b"[" * 100 + b"]" * 100 + b"}", ADMIN_AUTH),
    ):
        raw = _raw("POST", path, [auth, f"Content-Length: {len(body)}"], body)
        for role, r in (await _each_worker(daemon.port, raw)).items():
            assert (r.status, _json_error(r)["code"]) == (400, "invalid_input"), (role, path, r.body)
    # A shallow identity (extra_keys 3 deep) is stored as before.
    ok = meta({"block_hash": 5, "token_ids": [1, 2], "extra_keys": [["lora", [1]]]})
    raw = _raw("PUT", "/v1/blocks/shallow", [t1, ok, "Content-Length: 4"], b"data")
    assert {r.status for r in (await _each_worker(daemon.port, raw)).values()} == {200, 201}
    await _quiet(daemon)


# -- Expect and 100-continue ---------------------------------------------------


async def test_expect_header_echoed_in_text_plain_417_before_authentication(daemon: Daemon) -> None:
    """Item 5: 'Expect: Bearer <admin token>' was answered, before
    authentication, with a text/plain 417 'Unknown Expect: Bearer <admin
    token>'. Now a JSON error with a fixed message: 401 without a valid
    token, 417 expectation_failed with one, 404 on an unknown path; never
    the header's value; on every worker."""
    tokens = await _start_two_workers(daemon)
    expect = f"Expect: Bearer {ADMIN}"
    cases = [
        ("PUT", "/v1/blocks/k", [expect], 401, "unauthorized"),
        ("PUT", "/v1/blocks/k", [expect, f"Authorization: Bearer {tokens['t1']}"], 417, "expectation_failed"),
        ("POST", "/v1/admin/tenants", [expect, ADMIN_AUTH], 417, "expectation_failed"),
        ("GET", "/v1/stats", [expect, f"Authorization: Bearer {tokens['t1']}"], 417, "expectation_failed"),
        ("GET", "/healthz", [expect], 417, "expectation_failed"),
        ("PUT", "/v1/nowhere", [expect], 404, "not_found"),
    ]
    for method, path, headers, status, code in cases:
        raw = _raw(method, path, [*headers, "Content-Length: 4"], b"data")
        for role, r in (await _each_worker(daemon.port, raw)).items():
            err = _json_error(r)
            assert (r.status, err["code"]) == (status, code), (role, method, path, r.status, err)
            assert ADMIN[:12] not in r.body.decode("latin-1") and "Expect" not in err["message"][:7], r.body
    await _quiet(daemon)


async def _first_answer(conn: Conn, raw: bytes) -> bytes:
    """Send ``raw``; the first status line that comes back."""
    await conn.send(raw)
    return await asyncio.wait_for(conn.reader.readuntil(b"\r\n"), 10)


async def _on(port: int, role: str) -> Conn:
    """A fresh connection to a worker of ``role``."""
    conns = await worker_connections("127.0.0.1", port)
    for other, conn in conns.items():
        if other != role:
            await conn.close()
    return conns[role]


async def test_100_continue_sent_before_authentication(daemon: Daemon) -> None:
    """Item 5: a PUT with 'Expect: 100-continue' and no valid token got
    '100 Continue', then 401, so the client sent its body for nothing. Now
    100 comes only after the gate (token, path): a refused request gets its
    error first, with 'Connection: close' (the body it announced was never
    asked for); an accepted one gets 100, then its answer; an HTTP/1.0
    request never gets 100 (RFC 9110 §10.1.1). On every worker."""
    tokens = await _start_two_workers(daemon)
    t1 = f"Authorization: Bearer {tokens['t1']}"
    head = "Expect: 100-continue"
    for role in ("writer", "reader"):
        for refused, status in (
            (_raw("PUT", "/v1/blocks/c", [head, "Content-Length: 4"]), b"401"),
            (_raw("PUT", "/v1/blocks/c", [head, "Authorization: Bearer wrong", "Content-Length: 4"]), b"401"),
            (_raw("PUT", "/v1/blocks/bad%2Fkey", [head, t1, "Content-Length: 4"]), b"400"),
            (_raw("POST", "/v1/admin/tenants", [head, t1, "Content-Length: 4"]), b"401"),
            (_raw("PUT", "/v1/nowhere", [head, t1, "Content-Length: 4"]), b"404"),
        ):
            conn = await _on(daemon.port, role)
            line = await _first_answer(conn, refused)
            assert line.split()[1] == status, (role, refused[:40], line)
            headers = (await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)).lower()
            assert b"connection: close" in headers, (role, refused[:40], headers)
            await conn.close()
        conn = await _on(daemon.port, role)
        line = await _first_answer(conn, _raw("PUT", f"/v1/blocks/ok-{role}", [head, t1, "Content-Length: 4"]))
        assert line.startswith(b"HTTP/1.1 100"), (role, line)
        assert await conn.reader.readuntil(b"\r\n") == b"\r\n"
        await conn.send(b"data")
        assert (await conn.read_reply()).status == 201, role
        await conn.close()
        conn = await _on(daemon.port, role)
        raw = f"PUT /v1/blocks/old-{role} HTTP/1.0\r\nHost: x\r\n{t1}\r\n{head}\r\nContent-Length: 4\r\n\r\n"
        line = await _first_answer(conn, raw.encode() + b"data")
        assert line.split()[1] == b"201", (role, line)
        await conn.close()
    await _quiet(daemon)


# -- HTTP versions, Last-Event-ID and query parameters -------------------------


async def test_http2_and_http09_requests_served(daemon: Daemon) -> None:
    """Item 6: a request line with HTTP/2.0 was served and answered
    'HTTP/2.0 200 OK'; 'GET /v1/stats' without a version (HTTP/0.9) got an
    answer a 0.9 client reads as a body without a status line; HTTP/9.9 was
    400. Each is now 505 http_version_not_supported with a JSON body, on
    every worker; HTTP/1.0 is still served."""
    tokens = await _start_two_workers(daemon)
    t1 = f"Authorization: Bearer {tokens['t1']}"
    for raw in (
        f"GET /v1/stats HTTP/2.0\r\nHost: x\r\n{t1}\r\n\r\n".encode(),
        f"PUT /v1/blocks/v2 HTTP/2.0\r\nHost: x\r\n{t1}\r\nContent-Length: 4\r\n\r\ndata".encode(),
        b"GET /v1/stats\r\n\r\n",
        b"GET /healthz HTTP/0.9\r\n\r\n",
        f"GET /v1/stats HTTP/9.9\r\nHost: x\r\n{t1}\r\n\r\n".encode(),
    ):
        for role, r in (await _each_worker(daemon.port, raw)).items():
            err = _json_error(r)
            assert (r.status, err["code"]) == (505, "http_version_not_supported"), (role, raw[:40], r.status)
    raw = f"GET /v1/stats HTTP/1.0\r\n{t1}\r\n\r\n".encode()
    for role, r in (await _each_worker(daemon.port, raw)).items():
        assert r.status == 200 and r.json()["tenant"] == "t1", role
    for role, r in (await _each_worker(daemon.port, _raw("HEAD", "/v1/blocks/v2", [t1]))).items():
        assert r.status == 404, role  # the HTTP/2.0 PUT stored nothing
    await _quiet(daemon)


async def test_negative_last_event_id_answered_with_a_gap(daemon: Daemon) -> None:
    """Item 6: 'Last-Event-ID: -5' was 200 with a gap event ({"first": 0,
    "last": -1}); the docs say 400. Now 400 invalid_input naming the header,
    as for any value that is not decimal digits; relayed the same by a
    reader."""
    tokens = await _start_two_workers(daemon)
    t1 = f"Authorization: Bearer {tokens['t1']}"
    for value in ("-5", "-1", "+5", "5_0", "0x10", "1e3", "\udcd9\udca5", "9" * 40):
        raw = _raw("GET", "/v1/events", [t1, f"Last-Event-ID: {value}"])
        for role, r in (await _each_worker(daemon.port, raw)).items():
            err = _json_error(r)
            assert (r.status, err["code"]) == (400, "invalid_input"), (role, value, r.status, err)
            assert "Last-Event-ID" in err["message"], err
    await _quiet(daemon)


async def test_lax_query_parameters_read_as_something_else(daemon: Daemon) -> None:
    """Item 6: POST /v1/admin/verify?deep=maybe ran a shallow scrub (anything
    but 1/true/yes was false); ?limit=² (a Unicode digit) was a 500; +5,
    5_0, 1e3 and nan were read as numbers; a parameter given twice was read
    once. Every boolean and numeric query parameter is now read as
    docs/openapi.yaml types it, or 400 invalid_input naming it; on every
    worker (the admin calls are relayed by a reader)."""
    tokens = await _start_two_workers(daemon)
    t1 = f"Authorization: Bearer {tokens['t1']}"
    bad = [
        ("POST", "/v1/admin/verify?deep=maybe", ADMIN_AUTH, "deep"),
        ("POST", "/v1/admin/verify?deep=", ADMIN_AUTH, "deep"),
        ("POST", "/v1/admin/verify?deep=true&deep=false", ADMIN_AUTH, "deep"),
        ("POST", "/v1/admin/flush?timeout_s=1e3", ADMIN_AUTH, "timeout_s"),
        ("POST", "/v1/admin/flush?timeout_s=nan", ADMIN_AUTH, "timeout_s"),
        ("POST", "/v1/admin/flush?timeout_s=%205", ADMIN_AUTH, "timeout_s"),
        ("POST", "/v1/admin/flush?timeout_s=1_0", ADMIN_AUTH, "timeout_s"),
        ("POST", "/v1/admin/compact?tenant=t1&tenant=t2", ADMIN_AUTH, "tenant"),
        ("GET", "/v1/keys?limit=%C2%B2", t1, "limit"),
        ("GET", "/v1/keys?limit=%D9%A5", t1, "limit"),
        ("GET", "/v1/keys?limit=+5", t1, "limit"),
        ("GET", "/v1/keys?limit=5&limit=6", t1, "limit"),
        ("GET", "/v1/events?since=5_0", t1, "since"),
        ("GET", "/v1/events?since=%2B5", t1, "since"),
        ("GET", "/v1/events?since=%D9%A5", t1, "since"),
    ]
    for method, target, auth, name in bad:
        raw = _raw(method, target, [auth, "Content-Length: 0"])
        for role, r in (await _each_worker(daemon.port, raw)).items():
            err = _json_error(r)
            assert (r.status, err["code"]) == (400, "invalid_input"), (role, target, r.status, err)
            assert repr(name) in err["message"], (target, err)
    for method, target, auth in (
        ("POST", "/v1/admin/verify?deep=TRUE", ADMIN_AUTH),
        ("POST", "/v1/admin/verify?deep=0", ADMIN_AUTH),
        ("POST", "/v1/admin/flush?timeout_s=2.5", ADMIN_AUTH),
        ("POST", "/v1/admin/compact?tenant=t1", ADMIN_AUTH),
        ("GET", "/v1/keys?limit=5", t1),
    ):
        for role, r in (await _each_worker(daemon.port, _raw(method, target, [auth, "Content-Length: 0"]))).items():
            assert r.status == 200, (role, target, r.status, r.body)
    await _quiet(daemon)


# -- start-up that cannot go on ------------------------------------------------


def _server(data_dir: Path, port: int, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "server.py"), "--data-dir", str(data_dir), "--listen", f"127.0.0.1:{port}"]
    return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=60)


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    """The start-up error: exit status 2, one line on stderr, no traceback."""
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr + out.stdout, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("kvstore")]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_port_in_use_ended_in_a_traceback(daemon: Daemon, tmp_path: Path) -> None:
    """Item 7: a port in use ended in a raw Python traceback, after the store
    was opened (and recovered) and closed again. Now one line naming the
    address, before the store is opened (the data directory is not even
    created); with --workers 2 too."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in ((), ("--workers", "2")):
            out = _server(daemon.data_dir, port, daemon.env, *extra)
            line = _one_line(out)
            assert f"listen=127.0.0.1:{port}" in line and "in use" in line, line
            assert not daemon.data_dir.exists(), extra
    # The S3 gateway's address, likewise.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        gw = taken.getsockname()[1]
        out = _server(daemon.data_dir, free_port(), daemon.env, "--s3-gateway-listen", f"127.0.0.1:{gw}")
        assert f"s3_gateway_listen=127.0.0.1:{gw}" in _one_line(out)
        assert not daemon.data_dir.exists()


def test_data_dir_under_a_file_ended_in_a_traceback(daemon: Daemon, tmp_path: Path) -> None:
    """Item 7: a data directory under a file (or a file given as the data
    directory) ended in a raw traceback (NotADirectoryError from the store).
    Now one line naming the setting and the path."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for data_dir in (blocker / "data", blocker / "deeper" / "data", blocker):
        for extra in ((), ("--workers", "2")):
            line = _one_line(_server(data_dir, free_port(), daemon.env, *extra))
            assert "data_dir=" in line and str(blocker) in line and "not a directory" in line, line


def test_misspelled_variable_ignored_silently(daemon: Daemon, tmp_path: Path) -> None:
    """Item 7: KVSTORE_DURABLITY=interval was ignored (the daemon ran with
    fsync), while the same typo as a TOML key stopped start-up. Now the
    variable stops start-up by name, with the closest setting; the TOML key
    gets the same hint. Variables other programs read (the client's token)
    are accepted."""
    line = _one_line(_server(daemon.data_dir, free_port(), {**daemon.env, "KVSTORE_DURABLITY": "interval"}))
    assert "KVSTORE_DURABLITY" in line and "did you mean KVSTORE_DURABILITY?" in line, line
    line = _one_line(_server(daemon.data_dir, free_port(), {**daemon.env, "KVSTORE_REQUEST_TIMEOUT": "5"}))
    assert "did you mean KVSTORE_REQUEST_TIMEOUT_S?" in line, line
    toml = tmp_path / "kvstore.toml"
    toml.write_text('durablity = "interval"\n')
    line = _one_line(_server(daemon.data_dir, free_port(), daemon.env, "--config", str(toml)))
    assert "unknown key 'durablity'" in line and "did you mean 'durability'?" in line, line
    assert not daemon.data_dir.exists()
    daemon.env = {**daemon.env, "KVSTORE_TOKEN": "kvs_for_the_client", "KVSTORE_DURABILITY": "interval"}
    daemon.start()
    daemon.stop()


# -- relays to the writer, request timeouts and request line limits ------------


async def _reader_conns(port: int, n: int) -> tuple[list[Conn], int]:
    """``n`` keep-alive connections to reader workers, and the writer's pid."""
    conns: list[Conn] = []
    writer_pid = 0
    while len(conns) < n:
        conn = await Conn.open("127.0.0.1", port)
        health = (await conn.request("GET", "/healthz")).json()
        if health["role"] == "reader":
            conns.append(conn)
        else:
            writer_pid = health["pid"]
            await conn.close()
    while not writer_pid:
        conn = await Conn.open("127.0.0.1", port)
        health = (await conn.request("GET", "/healthz")).json()
        writer_pid = health["pid"] if health["role"] == "writer" else 0
        await conn.close()
    return conns, writer_pid


async def test_reader_called_a_busy_writer_unavailable_under_a_connection_flood(daemon: Daemon) -> None:
    """Item 8: under a flood of connections a reader answered PUTs 503 and
    logged "the writer process is unavailable" at ERROR while the writer ran.
    The cause: the writer's private socket listened with aiohttp's default
    backlog of 128, and a unix socket refuses a connection at once (EAGAIN)
    when its accept queue is full, so the 129th relay opened at once failed.
    Here 300 PUTs are relayed while the writer is stopped for 1.5 s (its
    queue fills as under a flood): every one is stored (201), nothing is
    logged at ERROR."""
    tokens = await _start_two_workers(daemon)
    conns, writer_pid = await _reader_conns(daemon.port, 300)
    try:
        os.kill(writer_pid, signal.SIGSTOP)
        auth = _auth(tokens["t1"])
        tasks = [
            asyncio.create_task(c.request("PUT", f"/v1/blocks/f{i}", auth, b"x" * 64, 60)) for i, c in enumerate(conns)
        ]
        await asyncio.sleep(1.5)
        os.kill(writer_pid, signal.SIGCONT)
        answers = await asyncio.gather(*tasks)
        assert Counter(r.status for r in answers) == {201: 300}, Counter((r.status, r.code) for r in answers)
    finally:
        os.kill(writer_pid, signal.SIGCONT)
        for c in conns:
            await c.close()
    await _quiet(daemon)


async def test_admin_relay_had_no_read_timeout(daemon: Daemon) -> None:
    """Item 8: a reader relayed admin calls (and batch puts) to the writer
    with no read timeout: with the writer hung, they waited for ever, each
    holding a slot. Now an admin call is bounded like every relay
    (request_timeout_s + 30 s; a flush, its timeout_s more), and a call whose
    work has no bound (a scrub, a compaction) fails once the writer has not
    answered its health check for that long: 504 timeout, logged as a
    warning (the writer is slow, not gone), never "unavailable" at ERROR."""
    await _start_two_workers(daemon, request_timeout_s="1")
    conns, writer_pid = await _reader_conns(daemon.port, 3)
    loop = asyncio.get_running_loop()
    try:
        os.kill(writer_pid, signal.SIGSTOP)
        t0 = loop.time()
        answers = await asyncio.wait_for(
            asyncio.gather(
                conns[0].request("POST", "/v1/admin/verify?deep=true", {"Authorization": f"Bearer {ADMIN}"}, b"", 90),
                conns[1].request("POST", "/v1/admin/flush?timeout_s=0", {"Authorization": f"Bearer {ADMIN}"}, b"", 90),
                conns[2].request("GET", "/v1/admin/tenants", {"Authorization": f"Bearer {ADMIN}"}, b"", 90),
            ),
            90,
        )
        elapsed = loop.time() - t0
    finally:
        os.kill(writer_pid, signal.SIGCONT)
        for c in conns:
            await c.close()
    for r in answers:
        assert (r.status, _json_error(r)["code"]) == (504, "timeout"), (r.status, r.body)
    assert 30 < elapsed < 60, elapsed
    daemon.stop()
    assert "Traceback" not in daemon.output and " ERROR " not in daemon.output, daemon.output[-3000:]
    assert daemon.output.count("WARNING kvstore.http: ") >= 3, daemon.output[-3000:]


async def test_headers_had_no_receive_timeout_of_their_own(daemon: Daemon) -> None:
    """Item 8: a request whose headers never ended was only cut by the
    keep-alive timeout (75 s by default), closed without an answer. Now its
    line and headers must arrive within request_timeout_s of their first
    byte: 408 request_timeout (JSON), then the connection closes; on every
    worker. An idle keep-alive connection is still the keep-alive timeout's."""
    await _start_two_workers(daemon, request_timeout_s="1", keepalive_timeout_s="30")
    loop = asyncio.get_running_loop()
    for partial in (b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n", b"GE", b"PUT /v1/blocks/k HTTP/1.1\r\nContent-Le"):
        conns = await worker_connections("127.0.0.1", daemon.port)
        for role, conn in conns.items():
            t0 = loop.time()
            await conn.send(partial)
            r = await conn.read_reply(timeout=10)
            assert (r.status, _json_error(r)["code"]) == (408, "request_timeout"), (role, partial, r.status)
            assert loop.time() - t0 < 5, role
            assert await asyncio.wait_for(conn.reader.read(), 5) == b"", role  # then closed
            await conn.close()
    conns = await worker_connections("127.0.0.1", daemon.port)  # idle after a request: kept
    await asyncio.sleep(2.5)
    for role, conn in conns.items():
        assert (await conn.request("GET", "/healthz")).status == 200, role
        await conn.close()
    await _quiet(daemon)


async def test_over_long_request_line_answered_431(daemon: Daemon) -> None:
    """Item 8: a request target over the limit was answered 431
    headers_too_large (a header field's answer). Now 414 uri_too_long; a
    header field over 8190 bytes is still 431; on every worker."""
    await _start_two_workers(daemon)
    for raw, status, code in (
        (_raw("GET", "/v1/blocks/" + "k" * 9000, []), 414, "uri_too_long"),
        (_raw("GET", "/v1/stats?" + "q" * 9000, []), 414, "uri_too_long"),
        (_raw("GET", "/v1/stats", ["X-Big: " + "b" * 9000]), 431, "headers_too_large"),
    ):
        for role, r in (await _each_worker(daemon.port, raw)).items():
            assert (r.status, _json_error(r)["code"]) == (status, code), (role, raw[:30], r.status)
    await _quiet(daemon)


# -- admin answers, several ranges, readers' logs and relayed streams ----------


async def test_created_tenant_answered_no_tokens_beside_its_token(daemon: Daemon) -> None:
    """Item 9: POST /v1/admin/tenants answered '"tokens": []' beside the
    token it had just issued. The tenant's tokens now list it, on every
    worker (a reader relays the call)."""
    await _start_two_workers(daemon)
    conns = await worker_connections("127.0.0.1", daemon.port)
    try:
        for role, conn in conns.items():
            r = await conn.request(
                "POST", "/v1/admin/tenants", _auth(ADMIN), json.dumps({"name": f"n-{role}"}).encode()
            )
            doc = r.json()
            assert r.status == 201 and [t["id"] for t in doc["tokens"]] == [doc["token_id"]], (role, doc)
    finally:
        for conn in conns.values():
            await conn.close()


async def test_several_ranges_answered_206_with_one(daemon: Daemon) -> None:
    """Item 9: 'Range: bytes=0-4095,4096-' on a 4096-byte block answered 206
    with one range (the second was unsatisfiable and dropped), while the docs
    say several ranges get 200 with the whole block. Now a Range of several
    range-specs is 200 with the whole block whatever the block's size (GET
    /v1/blocks and /v1/records alike); one range-spec is 206; none
    satisfiable is 416."""
    tokens = await _start_two_workers(daemon)
    t1 = f"Authorization: Bearer {tokens['t1']}"
    block = os.urandom(4096)
    await _each_worker(daemon.port, _raw("PUT", "/v1/blocks/r", [t1, "Content-Length: 4096"], block))
    for rng, status, body in (
        ("bytes=0-4095,4096-", 200, block),
        ("bytes=0-9,5000-6000", 200, block),
        ("bytes=0-9,20-29", 200, block),
        ("bytes=0-9", 206, block[:10]),
        ("bytes=4000-,", 206, block[4000:]),
        ("bytes=4096-,5000-", 416, None),
    ):
        for role, r in (await _each_worker(daemon.port, _raw("GET", "/v1/blocks/r", [t1, f"Range: {rng}"]))).items():
            assert r.status == status, (role, rng, r.status)
            if body is not None:
                assert r.body == body, (role, rng)
        for role, r in (await _each_worker(daemon.port, _raw("GET", "/v1/records/r", [t1, f"Range: {rng}"]))).items():
            assert r.status == (200 if status == 206 else status), (role, rng, r.status)
            if status == 200:  # the whole record: its envelope says the block's bytes 0 to 4096
                assert b'"start":0' in r.body.replace(b" ", b"") and b'"end":4096' in r.body.replace(b" ", b""), role
    await _quiet(daemon)


async def test_reader_log_said_it_served_the_s3_gateway(daemon: Daemon) -> None:
    """Item 9: with several workers, each reader logged 'reader serving on
    ..., S3 gateway http://...', but only the writer binds the gateway. Now
    only the writer's line names it."""
    gateway = f"127.0.0.1:{free_port()}"
    await _start_two_workers(daemon, s3_gateway_listen=gateway)
    deadline = time.monotonic() + 10
    while "reader serving on" not in daemon.log.read_text() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    daemon.stop()
    lines = {
        role: [ln for ln in daemon.output.splitlines() if f"{role} serving on" in ln] for role in ("writer", "reader")
    }
    assert len(lines["writer"]) == 1 and f"S3 gateway http://{gateway}" in lines["writer"][0], lines
    assert len(lines["reader"]) == 1 and "S3 gateway" not in lines["reader"][0], lines


async def test_relayed_event_stream_held_a_reader_shutdown(daemon: Daemon) -> None:
    """Found by the header fuzzer: an event stream relayed by a reader ends
    only when the writer stops, and readers stop first, so SIGTERM waited
    shutdown_timeout_s (30 s) for the reader. Now a reader ends the streams
    it relays as it stops: the client's stream ends, and the daemon stops at
    once."""
    tokens = await _start_two_workers(daemon)
    conn = await _on(daemon.port, "reader")
    await conn.send(_raw("GET", "/v1/events", [f"Authorization: Bearer {tokens['t1']}"]))
    head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    t0 = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - t0 < 10
    rest = await asyncio.wait_for(conn.reader.read(), 5)
    assert rest.endswith(b"0\r\n\r\n"), rest[-100:]  # the chunked stream ended properly
    await conn.close()
    assert "Traceback" not in daemon.output and " ERROR " not in daemon.output, daemon.output[-3000:]
