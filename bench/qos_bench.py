"""kvstore-bench qos: what a tenant's QoS holds under load, in one run.

Starts the daemon (``kvstore serve``, one worker unless ``--workers``) on a fresh data
directory under /var/tmp, and in every round creates fresh ``direct``
tenants (no encryption, so the daemon's CPU is not the whole story), fills
them with ``--blocks`` blocks and reads each once (off the clock), measures,
and deletes them. Three measurements per round, each ``--duration`` seconds:

* ``limit``: one tenant with ``read_bytes_per_s`` and ``write_bytes_per_s``
  of ``--limit`` (default 50 MB/s, set by PATCH after the fill);
  ``--connections`` connections (default 4) GET its blocks, then as many PUT
  new blocks. MB/s = bytes of the answered GETs (the PUTs' bodies) / the wall
  time from the start to the last answer (at least ``--duration``), so any
  burst the daemon lets through at the start counts. Target: at most 1.1x the
  limit.
* ``flood``: tenants A and B, equal weights. A GETs blocks of ``--probe-size``
  on one connection, alone, then while B floods: ``--flood-connections``
  connections (default 16), half of them GETting B's blocks, half PUTting new
  ones, its process at niceness +``--flood-nice`` (default 10, so that its
  client's CPU does not show in A's latency on a small machine). B starts
  ``--warmup`` seconds before A's window and stops after it. A's GET p50 and
  p99 alone and under the flood, and their ratio (target: p99 at most 2x).
* ``weights``: two tenants with ``--weights`` (default 300 and 100), each
  GETting its blocks on ``--weight-connections`` connections (default 8) at
  once. Each tenant's MB/s = body bytes received inside the window (after
  ``--warmup``) / ``--duration``; the ratio of the two (target: within 10% of
  the weights' ratio).

Each load runs in a process of its own (one per tenant, so that the probe's
latency is not its own load's queueing), on a small HTTP/1.1 client: keep-alive
connections, one request at a time each, answers received by the kernel into
one reused buffer (``asyncio.BufferedProtocol``, uvloop when installed) and
counted, not kept. A 429 (``rate_limited``) or 503 (``overloaded``) is
counted, and the request is sent again after the answer's ``Retry-After``
(1 s when it has none); a request's latency runs from its first sending to
its answer, retries included. Also reported, per measurement: the daemon's
CPU seconds (``/proc``, with its workers), the load processes' own, and the
seconds each tenant waited in the daemon on a limit or for a transfer slot
(``kvstore_tenant_throttled_seconds_total`` in ``/metrics``). Every figure
is the median over ``--repeats`` rounds.

    kvstore-bench qos [--duration 10] [--repeats 3] [--size 2MiB] [--probe-size 2MiB] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from .harness import cpu_seconds, percentile, tree_cpu_seconds

MB = 1e6
DEFAULT_LIMIT = 50_000_000  # bytes per second
LIMIT_TOLERANCE = 1.10  # measured at most 10% over the limit
FLOOD_P99_TARGET = 2.0  # A's p99 under the flood, at most this times A's p99 alone
WEIGHT_TOLERANCE = 0.10  # the ratio of two tenants' bytes/s within 10% of the ratio of their weights
PHASES = ("limit", "flood", "weights")
# B's load process runs this much nicer than A's and the daemon: on a small machine the load
# generators share the daemon's cores, and B's client taking the CPU A's client needs would
# show in A's latency as if it were the daemon's (clients run on other hosts in production).
FLOOD_NICE = 10
RETRY_AFTER_DEFAULT_S = 1.0
RETRY_AFTER_MAX_S = 60.0
KEEP_BODY = 64 * 1024  # answers up to this long are kept (error bodies); longer ones only counted
RECV_BUFFER = 1 << 20
REQUEST_TIMEOUT_S = 120.0
MAX_ERRORS = 50  # per load: past this many unexpected answers the load stops


# -- pure helpers (tests/unit/test_qos_bench.py) ------------------------------------------


def parse_retry_after(value: str | None, default: float = RETRY_AFTER_DEFAULT_S) -> float:
    """A Retry-After header's delay in seconds: delta-seconds (a fraction is
    taken too), at most ``RETRY_AFTER_MAX_S``; ``default`` when absent or not
    a number (an HTTP-date is not expected from the daemon)."""
    if value is None:
        return default
    try:
        delay = float(value.strip())
    except ValueError:
        return default
    if delay != delay or delay < 0:  # NaN or negative
        return default
    return min(delay, RETRY_AFTER_MAX_S)


def parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """The status and the headers (names lower-cased) of an answer's head,
    without its closing blank line."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def request_head(method: str, path: str, host: str, token: str, length: int | None) -> bytes:
    """An HTTP/1.1 request's head, keep-alive, with ``Content-Length`` when ``length`` is given."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {token}"]
    if length is not None:
        lines += [f"Content-Length: {length}", "Content-Type: application/octet-stream"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def medians(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds that have it (NaNs left out; NaN when none has it)."""
    out: dict[str, float] = {}
    for name in dict.fromkeys(k for r in rounds for k in r):
        values = [float(r[name]) for r in rounds if name in r and r[name] == r[name]]
        out[name] = statistics.median(values) if values else float("nan")
    return out


def parse_weights(text: str) -> tuple[int, int]:
    """``--weights``: two weights 1..1000, the first the larger or equal, as "HI,LO"."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected two weights, e.g. 300,100")
    hi, lo = (int(p) for p in parts)
    if not (1 <= lo <= hi <= 1000):
        raise argparse.ArgumentTypeError(f"{text!r}: weights are 1 to 1000, the first at least the second")
    return hi, lo


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)", re.MULTILINE)
_TENANT_LABEL = re.compile(r'(?:^|,)tenant="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, name: str) -> dict[str, float]:
    """``name``'s samples per tenant (its ``tenant`` label) in Prometheus text."""
    out: dict[str, float] = {}
    for metric, labels, value in _SAMPLE.findall(text):
        if metric != name:
            continue
        tenant = _TENANT_LABEL.search(labels)
        if tenant is not None:
            out[tenant.group(1)] = out.get(tenant.group(1), 0.0) + float(value)
    return out


def targets(med: dict[str, float], limit: int, weights: tuple[int, int]) -> dict[str, dict[str, Any]]:
    """The targets against the medians: value, target (text), met (None: not measured)."""

    def row(name: str, target: str, test: Callable[[float], bool]) -> tuple[str, dict[str, Any]]:
        v = med.get(name, float("nan"))
        measured = v == v
        return name, {"value": v if measured else None, "target": target, "met": test(v) if measured else None}

    bound = limit * LIMIT_TOLERANCE / MB
    want = weights[0] / weights[1]
    return dict(
        (
            row("limit_get_mbps", f"<= {bound:g} MB/s", lambda v: v <= bound),
            row("limit_put_mbps", f"<= {bound:g} MB/s", lambda v: v <= bound),
            row("flood_p99_ratio", f"<= {FLOOD_P99_TARGET:g}x", lambda v: v <= FLOOD_P99_TARGET),
            row(
                "weights_ratio",
                f"{want:g} +- {WEIGHT_TOLERANCE:.0%}",
                lambda v: abs(v / want - 1) <= WEIGHT_TOLERANCE,
            ),
        )
    )


# -- the load generator's HTTP/1.1 connection ---------------------------------------------


@dataclass(slots=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes  # kept only when at most KEEP_BODY long
    nbytes: int  # the body's length
    reusable: bool  # the connection may carry the next request


class HttpConn(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time.
    Answers need a Content-Length (the daemon always sends one); their bodies
    are received into one reused buffer and counted, and only kept when short.
    Body bytes received between ``window`` (monotonic seconds) are counted in
    :attr:`window_bytes`."""

    def __init__(self, window: tuple[float, float] = (0.0, 0.0), bufsize: int = RECV_BUFFER) -> None:
        self.buf = bytearray(bufsize)
        self.view = memoryview(self.buf)
        self.window = window
        self.window_bytes = 0
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._answer: asyncio.Future[Answer] | None = None
        self._head = bytearray()
        self._in_body = False
        self._status = 0
        self._headers: dict[str, str] = {}
        self._length = 0
        self._remaining = 0
        self._kept = bytearray()

    # asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError(f"connection lost: {exc}" if exc else "connection closed by the server"))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self._received(nbytes)
        except ConnectionError as e:
            self._fail(e)
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool | None:
        return None  # close

    # ours

    def request(self, head: bytes, body: bytes | None = None) -> asyncio.Future[Answer]:
        if self.closed or self.transport is None:
            raise ConnectionError("the connection is closed")
        self._answer = asyncio.get_running_loop().create_future()
        self._head.clear()
        self._kept.clear()
        self._in_body = False
        self.transport.writelines([head, body] if body else [head])
        return self._answer

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    def _fail(self, exc: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)

    def _received(self, n: int) -> None:
        if self._answer is None or self._answer.done():
            raise ConnectionError("bytes from the server with no request outstanding")
        if self._in_body:
            self._body(0, n)
            return
        start = len(self._head)
        if not start:  # the usual case: the whole head in this read, found without a copy
            end = self.buf.find(b"\r\n\r\n", 0, n)
            if end < 0:
                self._head += self.view[:n]
                if len(self._head) > 65536:
                    raise ConnectionError("an answer's head over 64 KiB")
                return
            raw, body_from = bytes(self.view[:end]), end + 4
        else:  # a head split over reads: heads are short, so copy at most 64 KiB of this one
            self._head += self.view[: min(n, 65536)]
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > 65536:
                    raise ConnectionError("an answer's head over 64 KiB")
                return
            raw, body_from = bytes(self._head[:end]), end + 4 - start
            self._head.clear()
        self._status, self._headers = parse_head(raw)
        if "chunked" in self._headers.get("transfer-encoding", "").lower():
            raise ConnectionError("a chunked answer (this client reads Content-Length bodies only)")
        length = self._headers.get("content-length", "0")
        if not length.isdigit():
            raise ConnectionError(f"a bad Content-Length: {length[:40]!r}")
        self._length = self._remaining = int(length)
        self._in_body = True
        self._body(body_from, n - body_from)

    def _body(self, off: int, got: int) -> None:
        if got > self._remaining:
            raise ConnectionError("more bytes than the answer's Content-Length")
        if got:
            self._remaining -= got
            if self._length <= KEEP_BODY:
                self._kept += self.view[off : off + got]
            w0, w1 = self.window
            if w0 < w1 and w0 <= time.monotonic() < w1:
                self.window_bytes += got
        if self._remaining == 0:
            self._in_body = False
            assert self._answer is not None
            pending = self.transport.get_write_buffer_size() if self.transport is not None else 0
            # An answer before the whole request went out (an early 429 on a PUT): not reused.
            reusable = self._headers.get("connection", "").lower() != "close" and pending == 0
            self._answer.set_result(Answer(self._status, self._headers, bytes(self._kept), self._length, reusable))


# -- one load: a tenant's connections, in a process of its own ------------------------------


@dataclass
class LoadSpec:
    """One tenant's load. Times are seconds from the common start (t0)."""

    name: str
    port: int
    token: str
    op: str  # "get", "put" or "mixed" (even connections GET, odd ones PUT)
    connections: int
    keys: list[str]  # what GETs read, round-robin
    size: int  # a PUT's body
    put_prefix: str  # PUT keys: PREFIX-CONN-SEQ
    start_s: float  # first request
    stop_s: float  # no request started after this
    window: tuple[float, float]  # latencies of requests started in it; bytes received (PUTs: answered) in it
    nice: int = 0  # added to the load process's niceness


@dataclass
class LoadResult:
    name: str
    requests: int = 0  # answered 2xx
    nbytes: int = 0  # their bodies (GET: received, PUT: sent)
    window_bytes: int = 0
    rate_limited: int = 0  # 429s
    overloaded: int = 0  # 503s
    errors: int = 0  # other answers, and connections lost
    first_error: str = ""
    reconnects: int = 0
    retry_sleep_s: float = 0.0  # slept on Retry-After, all connections together
    last_answer_s: float = 0.0  # the last answer of any kind, from t0
    client_cpu_s: float = 0.0
    latencies: list[float] = field(default_factory=list)  # seconds, 2xx answers of requests started in the window

    def mbps(self, seconds: float) -> float:
        return self.nbytes / seconds / MB if seconds > 0 else float("nan")


async def _connect(port: int, window: tuple[float, float]) -> HttpConn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: HttpConn(window), "127.0.0.1", port)
    return proto


async def _one_connection(spec: LoadSpec, i: int, t0: float, res: LoadResult, conn: HttpConn, block: bytes) -> None:
    op = spec.op if spec.op != "mixed" else ("get" if i % 2 == 0 else "put")
    host = f"127.0.0.1:{spec.port}"
    start, stop = t0 + spec.start_s, t0 + spec.stop_s
    w0, w1 = t0 + spec.window[0], t0 + spec.window[1]
    if op == "get" and not spec.keys:
        raise ValueError(f"{spec.name}: GETs need keys")
    if op == "put":
        conn.window = (0.0, 0.0)  # a PUT's bytes count when answered, not its answer's body as it arrives
    key_i, seq = i, 0
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    try:
        while True:
            started = time.monotonic()
            if started >= stop or res.errors > MAX_ERRORS:
                return
            if op == "get":
                key = spec.keys[key_i % len(spec.keys)]
                key_i += 1
                head, body = request_head("GET", f"/v1/blocks/{key}", host, spec.token, None), None
            else:
                key = f"{spec.put_prefix}-{i}-{seq}"
                seq += 1
                head, body = request_head("PUT", f"/v1/blocks/{key}", host, spec.token, len(block)), block
            while True:  # the request, until answered or given up
                try:
                    if conn.closed:
                        conn = await _connect(spec.port, conn.window)
                        res.reconnects += 1
                    answer = await asyncio.wait_for(conn.request(head, body), REQUEST_TIMEOUT_S)
                except (TimeoutError, ConnectionError, OSError) as e:
                    conn.close()
                    res.errors += 1
                    res.first_error = res.first_error or f"{op} {key}: {type(e).__name__}: {e}"
                    if res.errors > MAX_ERRORS or time.monotonic() >= stop:
                        return
                    await asyncio.sleep(0.05)
                    continue
                now = time.monotonic()
                res.last_answer_s = max(res.last_answer_s, now - t0)
                if not answer.reusable:
                    res.window_bytes += conn.window_bytes
                    conn.window_bytes = 0
                    conn.close()
                if answer.status in (429, 503):
                    if answer.status == 429:
                        res.rate_limited += 1
                    else:
                        res.overloaded += 1
                    delay = parse_retry_after(answer.headers.get("retry-after"))
                    if now + delay >= stop:
                        return
                    res.retry_sleep_s += delay
                    await asyncio.sleep(delay)
                    continue
                break
            if 200 <= answer.status < 300:
                res.requests += 1
                n = answer.nbytes if op == "get" else len(block)
                res.nbytes += n
                if op == "put" and w0 <= now < w1:
                    res.window_bytes += n
                if w0 <= started < w1:
                    res.latencies.append(now - started)
            else:
                res.errors += 1
                if not res.first_error:
                    text = answer.body[:300].decode("utf-8", "replace")
                    res.first_error = f"{op} {key}: HTTP {answer.status}: {text}"
    finally:
        res.window_bytes += conn.window_bytes
        conn.window_bytes = 0
        conn.close()


async def _load(spec: LoadSpec, pipe: Connection) -> LoadResult:
    """Connect everything, say ready, wait for t0 from the parent, run."""
    res = LoadResult(spec.name)
    block = os.urandom(spec.size) if spec.op in ("put", "mixed") else b""
    # The window is only known once t0 is: connections are made with an empty one and given it after.
    conns = [await _connect(spec.port, (0.0, 0.0)) for _ in range(spec.connections)]
    pipe.send("ready")
    t0 = float(pipe.recv())  # blocks the loop, which has nothing to do yet
    for c in conns:
        c.window = (t0 + spec.window[0], t0 + spec.window[1])
    cpu0 = cpu_seconds()
    await asyncio.gather(*(_one_connection(spec, i, t0, res, c, block) for i, c in enumerate(conns)))
    res.client_cpu_s = cpu_seconds() - cpu0
    return res


def _child(spec: LoadSpec, pipe: Connection) -> None:
    """A load process's body: the result, or ("error", traceback), on the pipe."""
    try:
        if spec.nice:
            os.nice(spec.nice)
        try:
            import uvloop

            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        try:
            res = loop.run_until_complete(_load(spec, pipe))
        finally:
            loop.close()
        pipe.send(("ok", res))
    except Exception:  # noqa: BLE001 - any failure goes to the parent, which stops the run with it
        pipe.send(("error", f"{spec.name}: {traceback.format_exc()}"))


def _receive(pipe: Connection, timeout: float, what: str) -> Any:
    try:
        if pipe.poll(timeout):
            return pipe.recv()
    except EOFError:
        raise SystemExit(f"qos: {what}: its process exited") from None
    raise SystemExit(f"qos: {what} within {timeout:.0f} s")


@dataclass
class Measured:
    results: dict[str, LoadResult]
    wall_s: float
    daemon_cpu_s: float


def run_loads(daemon_pid: int, specs: list[LoadSpec]) -> Measured:
    """Run ``specs`` at once, each in a process of its own, from one t0;
    the daemon's CPU seconds over the whole of it."""
    ctx = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    procs = []
    try:
        for spec in specs:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(spec, theirs), daemon=True)
            proc.start()
            pipes.append(ours)
            procs.append(proc)
        for spec, pipe in zip(specs, pipes, strict=True):
            msg = _receive(pipe, 60, f"the load {spec.name} did not start")
            if msg != "ready":
                raise SystemExit(f"qos: the load failed to start: {msg[1] if isinstance(msg, tuple) else msg}")
        d0 = tree_cpu_seconds(daemon_pid)
        t0 = time.monotonic() + 0.02
        for pipe in pipes:
            pipe.send(t0)
        results: dict[str, LoadResult] = {}
        longest = max(s.stop_s for s in specs) + 2 * REQUEST_TIMEOUT_S
        for spec, pipe in zip(specs, pipes, strict=True):
            status, payload = _receive(pipe, max(1.0, t0 + longest - time.monotonic()), f"{spec.name} did not finish")
            if status != "ok":
                raise SystemExit(f"qos: a load failed: {payload}")
            results[spec.name] = payload
        wall = time.monotonic() - t0
        d1 = tree_cpu_seconds(daemon_pid)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    for r in results.values():
        if r.errors:
            print(f"  warning: {r.name}: {r.errors} failed requests, first: {r.first_error}", file=sys.stderr)
    return Measured(results, wall, d1 - d0)


# -- admin and fill (this process, plain http.client) ------------------------------------------


class Admin:
    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            text = e.read()[:500].decode("utf-8", "replace")
            hint = ""
            if method in ("POST", "PATCH") and body and "qos" in body and e.code == 400 and "qos" in text:
                hint = " (a daemon older than tenant QoS does not know the qos field)"
            raise SystemExit(f"qos: {method} {path}: HTTP {e.code}: {text}{hint}") from None
        return json.loads(raw) if raw else None

    def tenant(self, name: str, qos: dict[str, int] | None = None, policy: str = "direct") -> str:
        body: dict[str, Any] = {"name": name, "policy": policy}
        if qos:
            body["qos"] = qos
        token: str = self.call("POST", "/v1/admin/tenants", body)["token"]
        if qos:
            self.check_qos(name, qos)
        return token

    def check_qos(self, name: str, qos: dict[str, int]) -> None:
        """That GET shows the tenant's qos as it was set."""
        shown: dict[str, Any] = self.call("GET", f"/v1/admin/tenants/{name}").get("qos") or {}
        if any(shown.get(k) != v for k, v in qos.items()):
            raise SystemExit(f"qos: tenant {name}: set {qos}, GET shows {shown}")

    def waited(self, workers: int) -> dict[str, float]:
        """Each tenant's seconds waited on a limit or for a transfer slot so
        far (/metrics; with several workers, after their next snapshot)."""
        if workers > 1:
            time.sleep(0.6)  # each worker writes its metrics every 0.5 s
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as r:
            text = r.read().decode()
        return parse_metrics(text, "kvstore_tenant_throttled_seconds_total")

    def set_qos(self, name: str, qos: dict[str, int]) -> None:
        """PATCH the tenant's qos, and check it with GET."""
        self.call("PATCH", f"/v1/admin/tenants/{name}", {"qos": qos})
        self.check_qos(name, qos)

    def delete(self, name: str) -> None:
        self.call("DELETE", f"/v1/admin/tenants/{name}")


def fill(port: int, token: str, prefix: str, blocks: int, size: int) -> list[str]:
    """PUT ``blocks`` blocks of ``size`` random bytes, then GET each once
    (so that reads start warm); their keys."""
    block = os.urandom(size)
    keys = [f"{prefix}-{i:04d}" for i in range(blocks)]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    auth = {"Authorization": f"Bearer {token}"}
    try:
        for key in keys:
            conn.request("PUT", f"/v1/blocks/{key}", body=block, headers=auth)
            r = conn.getresponse()
            answer = r.read()
            if not 200 <= r.status < 300:
                raise SystemExit(f"qos: fill PUT {key}: HTTP {r.status}: {answer[:300]!r}")
        for key in keys:
            conn.request("GET", f"/v1/blocks/{key}", headers=auth)
            r = conn.getresponse()
            got = r.read()
            if r.status != 200 or got != block:
                raise SystemExit(f"qos: fill GET {key}: HTTP {r.status}, {len(got)} bytes")
    finally:
        conn.close()
    return keys


# -- the three measurements -------------------------------------------------------------------


class Round:
    def __init__(self, pid: int, port: int, admin: Admin, args: argparse.Namespace, r: int) -> None:
        self.pid, self.port, self.admin, self.args, self.r = pid, port, admin, args, r
        self.tenants: list[str] = []

    def tenant(self, label: str, qos: dict[str, int] | None = None, policy: str = "direct") -> tuple[str, str]:
        name = f"qos-r{self.r}-{label}"
        token = self.admin.tenant(name, qos, policy)
        self.tenants.append(name)
        return name, token

    def close(self) -> None:
        """Delete the round's tenants (their blocks with them); a failure is
        printed, so that it does not hide the one that ended the round."""
        for name in self.tenants:
            try:
                self.admin.delete(name)
            except SystemExit as e:
                print(f"  warning: {e}", file=sys.stderr)

    def measure(self, specs: list[LoadSpec], tenants: dict[str, str]) -> tuple[Measured, dict[str, float]]:
        """:func:`run_loads`, and the seconds each load's tenant (``tenants``:
        load name -> tenant) waited in the daemon meanwhile."""
        before = self.admin.waited(self.args.workers)
        m = run_loads(self.pid, specs)
        after = self.admin.waited(self.args.workers)
        return m, {load: after.get(t, 0.0) - before.get(t, 0.0) for load, t in tenants.items()}

    def spec(self, name: str, token: str, op: str, conns: int, keys: list[str], **kw: Any) -> LoadSpec:
        a = self.args
        base: dict[str, Any] = {"size": a.size, "start_s": 0.0, "stop_s": a.duration, "window": (0.0, a.duration)}
        base |= kw
        return LoadSpec(name, self.port, token, op, conns, keys, put_prefix=f"{name}-{self.r}", **base)

    def limit(self) -> dict[str, float]:
        a = self.args
        name, token = self.tenant("limit")
        keys = fill(self.port, token, "l", a.blocks, a.size)
        self.admin.set_qos(name, {"read_bytes_per_s": a.limit, "write_bytes_per_s": a.limit})
        out: dict[str, float] = {}
        for op, tag in (("get", "GET"), ("put", "PUT")):
            m, waited = self.measure([self.spec("limit", token, op, a.connections, keys)], {"limit": name})
            res = m.results["limit"]
            elapsed = max(a.duration, res.last_answer_s)
            mbps = res.mbps(elapsed)
            p = f"limit_{op}"
            out |= {
                f"{p}_mbps": mbps,
                f"{p}_ratio": mbps / (a.limit / MB),
                f"{p}_429": res.rate_limited,
                f"{p}_503": res.overloaded,
                f"{p}_errors": res.errors,
                f"{p}_requests": res.requests,
                f"{p}_daemon_cpu_s": m.daemon_cpu_s,
                f"{p}_client_cpu_s": res.client_cpu_s,
                f"{p}_waited_s": waited["limit"],
                f"{p}_retry_sleep_s": res.retry_sleep_s,
            }
            print(
                f"  limit {tag}: {mbps:.1f} MB/s over {elapsed:.2f} s ({mbps / (a.limit / MB):.2f}x the limit), "
                f"{res.rate_limited} x 429, {res.overloaded} x 503, {waited['limit']:.1f} s waited in the daemon; "
                f"daemon {m.daemon_cpu_s:.2f} CPU-s",
                flush=True,
            )
        return out

    def flood(self) -> dict[str, float]:
        a = self.args
        a_name, a_token = self.tenant("a", {"weight": 100})
        b_name, b_token = self.tenant("b", {"weight": 100})
        a_keys = fill(self.port, a_token, "a", a.blocks, a.probe_size)
        b_keys = fill(self.port, b_token, "b", a.blocks, a.size)
        alone, _ = self.measure([self.spec("a", a_token, "get", 1, a_keys, size=a.probe_size)], {})
        w0, w1 = a.warmup, a.warmup + a.duration
        probe = self.spec("a", a_token, "get", 1, a_keys, size=a.probe_size, start_s=w0, stop_s=w1, window=(w0, w1))
        # The flood goes on a little past the window, under A's last request.
        tail = min(1.0, a.duration / 4)
        flood = self.spec(
            "b", b_token, "mixed", a.flood_connections, b_keys, stop_s=w1 + tail, window=(w0, w1), nice=a.flood_nice
        )
        both, waited = self.measure([flood, probe], {"a": a_name, "b": b_name})
        la, lf, b = alone.results["a"].latencies, both.results["a"].latencies, both.results["b"]
        out = {
            "flood_alone_p50_ms": 1e3 * percentile(la, 0.5),
            "flood_alone_p99_ms": 1e3 * percentile(la, 0.99),
            "flood_alone_requests": len(la),
            "flood_p50_ms": 1e3 * percentile(lf, 0.5),
            "flood_p99_ms": 1e3 * percentile(lf, 0.99),
            "flood_requests": len(lf),
            "flood_b_mbps": b.window_bytes / a.duration / MB,
            "flood_b_429": b.rate_limited,
            "flood_b_503": b.overloaded,
            "flood_a_503": both.results["a"].overloaded + both.results["a"].rate_limited,
            "flood_errors": b.errors + both.results["a"].errors + alone.results["a"].errors,
            "flood_alone_daemon_cpu_s": alone.daemon_cpu_s,
            "flood_alone_client_cpu_s": alone.results["a"].client_cpu_s,
            "flood_daemon_cpu_s": both.daemon_cpu_s,
            "flood_client_cpu_s": b.client_cpu_s + both.results["a"].client_cpu_s,
            "flood_a_waited_s": waited["a"],
            "flood_b_waited_s": waited["b"],
        }
        out["flood_p99_ratio"] = out["flood_p99_ms"] / out["flood_alone_p99_ms"]
        print(
            f"  flood: A GET p50/p99 alone {out['flood_alone_p50_ms']:.1f}/{out['flood_alone_p99_ms']:.1f} ms "
            f"({len(la)} GETs), under B's flood {out['flood_p50_ms']:.1f}/{out['flood_p99_ms']:.1f} ms "
            f"({len(lf)} GETs): p99 {out['flood_p99_ratio']:.2f}x; B {out['flood_b_mbps']:.0f} MB/s, "
            f"{b.rate_limited} x 429, {b.overloaded} x 503; waited in the daemon: A {waited['a']:.2f} s, "
            f"B {waited['b']:.1f} s; daemon {both.daemon_cpu_s:.2f} CPU-s",
            flush=True,
        )
        return out

    def weights(self) -> dict[str, float]:
        a = self.args
        hi, lo = a.weights
        loads, names = [], {}
        for label, weight in (("hi", hi), ("lo", lo)):
            names[label], token = self.tenant(f"w{weight}-{label}", {"weight": weight}, a.weights_policy)
            keys = fill(self.port, token, label, a.blocks, a.size)
            w0, w1 = a.warmup, a.warmup + a.duration
            loads.append(self.spec(label, token, "get", a.weight_connections, keys, stop_s=w1, window=(w0, w1)))
        m, waited = self.measure(loads, names)
        h, lw = m.results["hi"], m.results["lo"]
        out = {
            "weights_hi_mbps": h.window_bytes / a.duration / MB,
            "weights_lo_mbps": lw.window_bytes / a.duration / MB,
            "weights_429": h.rate_limited + lw.rate_limited,
            "weights_503": h.overloaded + lw.overloaded,
            "weights_errors": h.errors + lw.errors,
            "weights_daemon_cpu_s": m.daemon_cpu_s,
            "weights_client_cpu_s": h.client_cpu_s + lw.client_cpu_s,
            "weights_hi_waited_s": waited["hi"],
            "weights_lo_waited_s": waited["lo"],
        }
        lo_mbps = out["weights_lo_mbps"]
        out["weights_ratio"] = out["weights_hi_mbps"] / lo_mbps if lo_mbps > 0 else float("nan")
        print(
            f"  weights {hi}:{lo}: {out['weights_hi_mbps']:.0f} and {lo_mbps:.0f} MB/s, ratio "
            f"{out['weights_ratio']:.2f} (want {hi / lo:g}); waited in the daemon {waited['hi']:.1f} and "
            f"{waited['lo']:.1f} s; daemon {m.daemon_cpu_s:.2f} CPU-s",
            flush=True,
        )
        return out


# -- output -----------------------------------------------------------------------------------


def _f(v: float, spec: str) -> str:
    return "-" if v != v else format(v, spec)


def render(med: dict[str, float], tg: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    """The medians as a compact table: one line per figure, with the 429s and
    503s its load got, the CPU seconds of the daemon and of the load
    processes, and the target's verdict where there is one."""

    def verdict(name: str) -> str:
        t = tg[name]
        return f"{t['target']} {'-' if t['met'] is None else ('ok' if t['met'] else 'MISS')}"

    nan = float("nan")

    def v(name: str, spec: str) -> str:
        return _f(med.get(name, nan), spec)

    size = _size(args.size)
    rows: list[tuple[str, ...]] = [
        ("", "value", "429/503", "waited s", "daemon CPU-s", "client CPU-s", "target"),
    ]

    def row(label: str, value: str, codes: str = "", waited: str = "", cpu: str = "", target: str = "") -> None:
        """``cpu``: the prefix of the figures ``*_daemon_cpu_s`` and ``*_client_cpu_s``."""
        dcpu, ccpu = (v(f"{cpu}_daemon_cpu_s", ".2f"), v(f"{cpu}_client_cpu_s", ".2f")) if cpu else ("", "")
        rows.append((label, value, codes, waited, dcpu, ccpu, target))

    if "limit" in args.phases:
        lim = args.limit / MB
        for op, tag in (("get", "GET"), ("put", "PUT")):
            p = f"limit_{op}"
            row(
                f"limit {lim:g} MB/s: {args.connections} conns of {size} {tag}s, MB/s",
                f"{v(f'{p}_mbps', '.1f')} ({v(f'{p}_ratio', '.2f')}x)",
                f"{v(f'{p}_429', '.0f')}/{v(f'{p}_503', '.0f')}",
                v(f"{p}_waited_s", ".1f"),
                p,
                verdict(f"{p}_mbps"),
            )
    if "flood" in args.phases:
        row(
            f"flood: A's 1 conn of {_size(args.probe_size)} GETs alone, p50/p99 ms",
            f"{v('flood_alone_p50_ms', '.1f')}/{v('flood_alone_p99_ms', '.1f')}",
            cpu="flood_alone",
        )
        row(
            f"  beside B's {args.flood_connections} conns of PUTs+GETs, p50/p99 ms",
            f"{v('flood_p50_ms', '.1f')}/{v('flood_p99_ms', '.1f')}",
            f"{v('flood_b_429', '.0f')}/{v('flood_b_503', '.0f')}",
            f"{v('flood_a_waited_s', '.2f')}:{v('flood_b_waited_s', '.1f')}",
            "flood",
        )
        row("  p99 beside the flood / alone", v("flood_p99_ratio", ".2f") + "x", target=verdict("flood_p99_ratio"))
        row("  B's MB/s meanwhile", v("flood_b_mbps", ".0f"))
    if "weights" in args.phases:
        hi, lo = args.weights
        row(
            f"weights {hi}:{lo}: {args.weight_connections} conns of {size} GETs each, MB/s",
            f"{v('weights_hi_mbps', '.0f')}:{v('weights_lo_mbps', '.0f')}",
            f"{v('weights_429', '.0f')}/{v('weights_503', '.0f')}",
            f"{v('weights_hi_waited_s', '.1f')}:{v('weights_lo_waited_s', '.1f')}",
            "weights",
        )
        row("  ratio", v("weights_ratio", ".2f"), target=verdict("weights_ratio"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    head = (
        f"qos: {args.workers} worker(s), {size} blocks, {args.duration:g} s windows, medians of {args.repeats} round(s)"
    )
    lines = [head]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:6], widths[1:], strict=True)]
        lines.append("  ".join([*cells, r[6]]).rstrip())
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _json_safe(v: object) -> object:
    return None if isinstance(v, float) and v != v else v


# -- main ---------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    from kvstore.config import parse_size as parse
    from kvstore.errors import ConfigError

    try:
        return int(parse("--size", text))
    except (ConfigError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: Callable[[str], float]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return check


def _phases(text: str) -> list[str]:
    items = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in items if p not in PHASES]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(PHASES)}")
    return [p for p in PHASES if p in items]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvstore-bench qos", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--duration", type=_positive(float), default=10.0, help="seconds per window (default 10)")
    ap.add_argument("--repeats", type=_positive(int), default=3, help="rounds; figures are medians (default 3)")
    ap.add_argument("--size", type=parse_size, default=2 << 20, help="bytes per block (default 2MiB)")
    ap.add_argument("--probe-size", type=parse_size, help="bytes per block of A's GETs in flood (default --size)")
    ap.add_argument("--blocks", type=_positive(int), default=16, help="blocks filled per reading tenant (default 16)")
    ap.add_argument(
        "--limit",
        type=_positive(int),
        default=DEFAULT_LIMIT,
        help=f"read_bytes_per_s and write_bytes_per_s of limit's tenant (default {DEFAULT_LIMIT})",
    )
    ap.add_argument("--connections", type=_positive(int), default=4, help="limit's connections (default 4)")
    ap.add_argument("--flood-connections", type=_positive(int), default=16, help="B's connections (default 16)")
    ap.add_argument("--weight-connections", type=_positive(int), default=8, help="per tenant in weights (default 8)")
    ap.add_argument(
        "--flood-nice",
        type=int,
        default=FLOOD_NICE,
        help=f"niceness added to B's load process in flood (default {FLOOD_NICE}): its client's CPU is not A's latency",
    )
    ap.add_argument("--weights", type=parse_weights, default=(300, 100), help="HI,LO (default 300,100)")
    ap.add_argument(
        "--weights-policy",
        choices=("direct", "sealed"),
        default="direct",
        help="the weights tenants' policy (default direct); sealed GETs are decoded by the daemon: its CPU saturates",
    )
    ap.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of load before flood's and weights' windows (default 1)"
    )
    ap.add_argument("--phases", type=_phases, default=list(PHASES), help=f"a subset of {','.join(PHASES)}")
    ap.add_argument("--workers", type=_positive(int), default=1, help="daemon worker processes (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a daemon setting (repeatable)")
    ap.add_argument("--json", type=Path, metavar="PATH", help="write every round's figures and the medians")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.warmup < 0:
        ap.error("argument --warmup: must be at least 0")
    if args.probe_size is None:
        args.probe_size = args.size
    settings = {"max_block_size": str(max(args.size, args.probe_size, 4 << 20))}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            ap.error(f"argument --set: {item!r}: expected NAME=VALUE")
        settings[name] = value

    from .daemon import daemon

    rounds: list[dict[str, float]] = []
    with daemon(settings, ["--workers", str(args.workers)]) as d:
        port = int(d.base.rpartition(":")[2])
        admin = Admin(d.base, d.admin)
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}", flush=True)
            rnd = Round(d.proc.pid, port, admin, args, r)
            figures: dict[str, float] = {}
            try:
                for phase in args.phases:
                    figures |= getattr(rnd, phase)()
            finally:
                rnd.close()
            rounds.append(figures)
    med = medians(rounds)
    tg = targets(med, args.limit, args.weights)
    print(render(med, tg, args))
    if args.json is not None:
        doc = {
            "benchmark": "kvstore qos_bench",
            "settings": settings,
            "args": {
                k: v if isinstance(v, int | float | str | list | tuple) else str(v) for k, v in vars(args).items()
            },
            "units": {
                "*_mbps": "1e6 bytes of block bodies per second",
                "*_ms": "milliseconds from a request's first sending to its answer, retries included",
                "*_429, *_503": "answers counted (the request was sent again after Retry-After)",
                "*_cpu_s": "CPU seconds over the measurement (daemon: all its processes; client: the loads')",
                "*_waited_s": "seconds the tenant's requests waited in the daemon on a limit or for a transfer slot "
                "(kvstore_tenant_throttled_seconds_total)",
                "*_retry_sleep_s": "seconds the load's connections slept on Retry-After",
            },
            "rounds": [{k: _json_safe(v) for k, v in r.items()} for r in rounds],
            "medians": {k: _json_safe(v) for k, v in med.items()},
            "targets": {k: {kk: _json_safe(vv) for kk, vv in t.items()} for k, t in tg.items()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
