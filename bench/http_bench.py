"""kvstore over HTTP against nginx serving the same bytes with sendfile, driven by wrk.

A benchmark, not a test. It starts everything it measures as processes of its
own and removes them (and its temporary directory) at the end, on errors and on
Ctrl-C:

* the kvstore daemon (``kvstore serve``) on a fresh data directory on disk, with a
  fresh master key and admin token, and one ``sealed`` and one ``direct``
  tenant, each loaded with ``--blocks`` 2 MiB blocks of the real KV-cache
  samples (the package's ``data/kv``; the few distinct sample blocks are reused
  round-robin under distinct keys) by plain HTTP PUTs;
* nginx (``/usr/sbin/nginx``, Debian package ``nginx``) with a minimal config
  of its own (sendfile on, access_log off, ``worker_processes`` = kvstore's
  ``--workers``) serving the same block bytes as plain files;
* wrk (Debian package ``wrk``) with a generated Lua script per phase that walks
  the keys round-robin, sets ``Authorization: Bearer`` and ``Range`` as needed,
  and prints its figures as JSON from its ``done()`` hook.

Phases, each ``--duration`` seconds with ``-t THREADS -c CONNECTIONS``:
GET of whole blocks (kvstore sealed, kvstore direct, nginx), Range GET of
``--range-size`` bytes at varying offsets (the same three), PUT of whole blocks
to new keys (kvstore sealed and direct, into scratch tenants deleted afterwards),
and POST /v1/lookup of ``--chain``-key chains (at CONNECTIONS and at 1
connection). All of it for each ``--workers`` count; a daemon that refuses a
count ("only 1 worker process is supported") makes that count "not available".

Run: ``python -m kvstore_bench.http_bench --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.config import KiB, MiB, parse_size

from .daemon import Kvstore, Unavailable
from .harness import Client, Processes, Reply, free_port, group_cpu_seconds, sigterm_as_exit
from .samples import SAMPLES
from .store_bench import GB, MEMORY_FS, default_base_dir, fmt, load_samples, mount_of

NGINX = Path("/usr/sbin/nginx")
INSTALL_HINT = "apt-get update && apt-get install -y nginx wrk"
PEERS_GET = ("sealed", "sealed hot", "records", "direct", "nginx")
HOT_BLOCKS = 16  # the "sealed hot" peer's blocks: 32 MiB, within the default decoded_cache_bytes
PHASES = ("get", "range", "put", "lookup")
TARGETS = {
    "direct GET / nginx": ">= 1.0x",
    "sealed GET / nginx": ">= 0.6x",
    "records GET / nginx": ">= 1.0x (the daemon's bytes sent per second)",
    "direct Range / nginx": ">= 0.9x",
    "direct Range CPU/req / nginx": "<= 2.0x",
    "sealed hot GET / direct": ">= 0.8x (blocks in the decoded-blocks cache)",
    "sealed hot Range / nginx": ">= 0.5x",
    "lookup p99 (CONNECTIONS conns)": "< 2 ms",
    "lookup p99 (1 conn, CONNECTIONS conns of GETs)": "< 2 ms",
}
LOOKUP_P99_TARGET_MS = 2.0
NOTES = [
    "GB/s = 1e9 bytes of response bodies (request bodies for PUT) of successful requests / wrk's duration.",
    "Latency = wrk's, from writing a request to reading the whole response, per request.",
    "kvstore records = the sealed tenant's blocks as stored (GET /v1/records: compressed, encrypted frames, "
    "with the record's own key) for a client that decodes them itself; its GB/s counts the plaintext the client "
    "gets, its 'vs nginx' compares the bytes the daemon sent per second (wire_gbps) with nginx's. wrk does not "
    "decode: the client's decode speed is kvstore-bench codec's client_decode_gbps.",
    "Blocks are the distinct 2 MiB blocks cut from the KV samples, reused round-robin under distinct keys "
    "(the store compresses and seals each record on its own and does not deduplicate).",
    "PUT writes a new key per request (wrk's Lua numbers them): the store is content-addressed and first write "
    "wins, so a repeated key would be answered 200 without writing anything. Scratch tenants, deleted afterwards.",
    "Everything is in the page cache (the blocks were just written and read once to verify them): warm reads.",
    "wrk runs on the same machine and takes CPU from the servers; its CPU is reported as client CPU.",
]

Figures = dict[str, float]


# -- options ----------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    blocks: int
    block_size: int
    range_size: int
    chain: int
    duration: int
    connections: int
    threads: int
    workers: list[int]
    phases: list[str]
    durability: str
    samples: Path
    base: Path | None
    keep: bool
    quick: bool


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvstore_bench.http_bench",
        description="kvstore's HTTP API against nginx (sendfile) on the same bytes, under wrk (see bench/README.md).",
    )
    p.add_argument("--blocks", type=int, help="blocks loaded into each tenant and nginx (default 256; --quick 32)")
    p.add_argument("--block-size", default="2MiB", help="block size (default 2MiB)")
    p.add_argument("--range-size", default="256KiB", help="bytes per Range GET (default 256KiB)")
    p.add_argument("--chain", type=int, default=128, help="keys per POST /v1/lookup (default 128)")
    p.add_argument("-d", "--duration", type=int, help="seconds per wrk phase (default 10; --quick 2)")
    p.add_argument("-c", "--connections", type=int, default=8, help="wrk connections (default 8)")
    p.add_argument("-t", "--threads", type=int, default=2, help="wrk threads (default 2)")
    p.add_argument("--workers", default="1,2", help="kvstore --workers counts to run, comma-separated (default 1,2)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--durability", choices=("fsync", "interval"), default="fsync", help="the daemon's (default fsync)")
    p.add_argument("--samples", type=Path, default=SAMPLES, help="directory of *.bf16*.bin / *.f16*.bin")
    p.add_argument("--dir", type=Path, help="parent of the temporary directory (default: a disk-backed temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (data dir, logs, Lua scripts)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 s per phase, 32 blocks")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure as JSON")
    return p.parse_args(argv)


def build_options(a: argparse.Namespace) -> Options:
    def csv(value: str, what: str) -> list[str]:
        items = list(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
        if not items:
            raise ValueError(f"--{what}={value!r}: empty")
        return items

    phases = csv(a.phases, "phases")
    bad = [x for x in phases if x not in PHASES]
    if bad:
        raise ValueError(f"--phases={a.phases!r}: unknown {','.join(bad)}; expected a subset of {','.join(PHASES)}")
    try:
        workers = [int(x) for x in csv(a.workers, "workers")]
    except ValueError:
        raise ValueError(f"--workers={a.workers!r}: expected comma-separated positive integers") from None
    block = parse_size("--block-size", a.block_size)
    rng = parse_size("--range-size", a.range_size)
    blocks = a.blocks if a.blocks is not None else (32 if a.quick else 256)
    duration = a.duration if a.duration is not None else (2 if a.quick else 10)
    if min(workers) < 1 or blocks < 1 or duration < 1 or a.chain < 1:
        raise ValueError("--workers, --blocks, --duration and --chain must be at least 1")
    if not 1 <= rng <= block:
        raise ValueError(f"--range-size ({rng}) must be 1 to --block-size ({block})")
    if a.threads < 1 or a.connections < a.threads:
        raise ValueError(f"wrk needs 1 <= --threads ({a.threads}) <= --connections ({a.connections})")
    return Options(
        blocks=blocks,
        block_size=block,
        range_size=rng,
        chain=a.chain,
        duration=duration,
        connections=a.connections,
        threads=a.threads,
        workers=workers,
        phases=phases,
        durability=a.durability,
        samples=a.samples,
        base=a.dir,
        keep=a.keep,
        quick=a.quick,
    )


# -- the data set ----------------------------------------------------------------------------


@dataclass(slots=True)
class DataSet:
    keys: list[str]
    distinct: list[bytes]  # the distinct sample blocks; key i holds distinct[i % len(distinct)]
    offsets: list[int]  # Range GET offsets
    sources: dict[str, int]  # sample file -> blocks cut from it

    def block(self, i: int) -> bytes:
        return self.distinct[i % len(self.distinct)]


def make_dataset(opts: Options) -> DataSet:
    sets = load_samples(opts.samples, opts.block_size, ("bf16", "fp16"))
    distinct = [b for d in ("bf16", "fp16") for b in sets[d].blocks]
    if not distinct:
        raise ValueError(f"no sample of at least one block ({opts.block_size} B) in {opts.samples}")
    sources = {f: c for s in sets.values() for f, c in s.files.items()}
    # Keys like a client's content hashes (chained prefix hashes in an engine).
    keys = [f"blk-{hashlib.sha256(f'kv-block-{i}'.encode()).hexdigest()[:40]}" for i in range(opts.blocks)]
    rng = random.Random(20261122)
    span = opts.block_size - opts.range_size
    offsets = [0, span] + [rng.randrange(0, span // (4 * KiB) + 1) * 4 * KiB for _ in range(62)] if span else [0]
    return DataSet(keys, distinct, offsets, sources)


# -- loading and checking a peer -------------------------------------------------------


def parallel(n_threads: int, items: Sequence[int], fn: Callable[[int, threading.local], None]) -> None:
    """Run ``fn(item, thread_local)`` over ``items`` on ``n_threads`` threads."""
    local = threading.local()
    with ThreadPoolExecutor(n_threads) as ex:
        for f in [ex.submit(fn, i, local) for i in items]:
            f.result()


def load_tenant(kv: Kvstore, tenant: str, data: DataSet) -> float:
    """PUT every block; returns the seconds it took."""
    clients: list[Client] = []

    def put(i: int, local: threading.local) -> None:
        if not hasattr(local, "c"):
            local.c = Client(kv.port, kv.tokens[tenant])
            clients.append(local.c)
        r: Reply = local.c.request("PUT", f"/v1/blocks/{data.keys[i]}", data.block(i))
        if r.status not in (200, 201):
            raise RuntimeError(f"PUT {data.keys[i]} to {tenant}: HTTP {r.status}: {r.body[:300]!r}")

    t0 = time.perf_counter()
    try:
        parallel(4, range(len(data.keys)), put)
    finally:
        for c in clients:
            c.close()
    return time.perf_counter() - t0


def verify_peer(port: int, token: str, prefix: str, data: DataSet, range_size: int) -> None:
    """GET every block (and a range of each) and compare: checks the peer serves the
    right bytes and leaves them in the page cache before the timed phases."""
    clients: list[Client] = []

    def check(i: int, local: threading.local) -> None:
        if not hasattr(local, "c"):
            local.c = Client(port, token)
            clients.append(local.c)
        c: Client = local.c
        path = prefix + data.keys[i]
        r = c.request("GET", path)
        if r.status != 200 or r.body != data.block(i):
            raise RuntimeError(f"GET {path} on port {port}: HTTP {r.status}, {len(r.body)} bytes: not the block put")
        off = data.offsets[i % len(data.offsets)]
        r = c.request("GET", path, headers={"Range": f"bytes={off}-{off + range_size - 1}"})
        if r.status != 206 or r.body != data.block(i)[off : off + range_size]:
            raise RuntimeError(f"Range GET {path} @{off} on port {port}: HTTP {r.status}: not the bytes put")

    try:
        parallel(2, range(len(data.keys)), check)
    finally:
        for c in clients:
            c.close()


# -- nginx ----------------------------------------------------------------------------------


NGINX_CONF = """\
# generated by bench/http_bench.py: serve {www} as plain files, sendfile on
{user}worker_processes {workers};
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{
    worker_connections 1024;
}}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000000;
    keepalive_timeout 75s;
    default_type application/octet-stream;
    types {{ }}
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {www};
        location / {{ }}
    }}
}}
"""


@dataclass
class Nginx:
    procs: Processes
    root: Path  # holds www/blk/<key> and the nginx prefix
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def www(self) -> Path:
        return self.root / "www"

    def write_files(self, data: DataSet) -> None:
        d = self.www / "blk"
        d.mkdir(parents=True, exist_ok=True)
        for i, key in enumerate(data.keys):
            (d / key).write_bytes(data.block(i))

    def start(self, workers: int) -> None:
        self.port = free_port()
        prefix = self.root / f"nginx-w{workers}"
        prefix.mkdir(exist_ok=True)
        # As root, nginx's workers would switch to "nobody", who cannot enter a 0700 temp dir.
        user = "user root root;\n" if os.geteuid() == 0 else ""
        conf = prefix / "nginx.conf"
        conf.write_text(NGINX_CONF.format(user=user, workers=workers, prefix=prefix, port=self.port, www=self.www))
        log = prefix / "stdout.log"
        cmd = [str(NGINX), "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log")]
        self.proc = self.procs.spawn(cmd, log)
        try:
            self._wait(prefix)
        except BaseException:
            self.stop()
            raise

    def _wait(self, prefix: Path) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (prefix / "error.log").read_text(errors="replace") if (prefix / "error.log").exists() else ""
                raise RuntimeError(f"nginx exited with status {self.proc.returncode}:\n{err[-3000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.05)
        raise RuntimeError("nginx did not start listening within 30 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.stop(self.proc, signal.SIGQUIT, timeout=30)  # SIGQUIT: graceful shutdown
            self.proc = None

    @property
    def pgid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


# -- wrk --------------------------------------------------------------------------------------


def lua_str(s: str) -> str:
    return json.dumps(s)  # a JSON string of ASCII text is a valid Lua string literal


def lua_list(items: Sequence[str]) -> str:
    return "{" + ", ".join(lua_str(x) for x in items) + "}"


WRK_LUA = """\
-- generated by bench/http_bench.py
local method = {method}
local paths = {paths}          -- walked round-robin, each thread from its own starting point
local ranges = {ranges}        -- Range header per path ({{}}: none)
local body_files = {body_files}  -- request bodies, cycled (POST/PUT)
local token = {token}
local content_type = {content_type}
local unique_prefix = {unique_prefix}  -- PUT: "/v1/blocks/<prefix><thread>-<n>", a new key per request
local n_threads = {threads}

local reqs = {{}}
local bodies = {{}}
local idx = 1
local counter = 0
local next_tid = 0

function setup(thread)
  thread:set("tid", next_tid)
  next_tid = next_tid + 1
end

local function headers(i)
  local h = {{}}
  if token ~= "" then h["Authorization"] = "Bearer " .. token end
  if i and ranges[i] then h["Range"] = ranges[i] end
  if content_type ~= "" then h["Content-Type"] = content_type end
  return h
end

function init(args)
  for _, name in ipairs(body_files) do
    local f = assert(io.open(name, "rb"))
    bodies[#bodies + 1] = f:read("*a")
    f:close()
  end
  if unique_prefix == "" then
    for i, p in ipairs(paths) do
      local body = nil
      if #bodies > 0 then body = bodies[(i - 1) % #bodies + 1] end
      reqs[i] = wrk.format(method, p, headers(i), body)
    end
    idx = math.floor(tid * #reqs / n_threads) % #reqs + 1
  end
end

function request()
  counter = counter + 1
  if unique_prefix ~= "" then
    local path = "/v1/blocks/" .. unique_prefix .. tid .. "-" .. counter
    return wrk.format(method, path, headers(nil), bodies[(counter + tid) % #bodies + 1])
  end
  local r = reqs[idx]
  idx = idx % #reqs + 1
  return r
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {{"duration_us": %.0f, "requests": %.0f, "bytes": %.0f, ' ..
    '"errors": {{"connect": %.0f, "read": %.0f, "write": %.0f, "status": %.0f, "timeout": %.0f}}, ' ..
    '"latency_us": {{"min": %.0f, "mean": %.1f, "stdev": %.1f, "max": %.0f, ' ..
    '"p50": %.0f, "p90": %.0f, "p99": %.0f, "p99.9": %.0f}}}}\\n',
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.stdev, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9)))
end
"""


@dataclass(slots=True)
class Load:
    """One wrk phase: what to request."""

    name: str
    port: int
    pgid: int  # the server's process group, for its CPU time
    method: str = "GET"
    paths: list[str] = field(default_factory=list)
    ranges: list[str] = field(default_factory=list)
    body_files: list[str] = field(default_factory=list)
    token: str = ""
    content_type: str = ""
    unique_prefix: str = ""
    body_size: int = 0  # bytes of body per successful request counted as throughput (0: none)
    connections: int = 8
    threads: int = 2


def run_wrk(load: Load, opts: Options, workdir: Path, procs: Processes) -> Figures:
    script = workdir / f"{load.name}.lua"
    script.write_text(
        WRK_LUA.format(
            method=lua_str(load.method),
            paths=lua_list(load.paths),
            ranges=lua_list(load.ranges),
            body_files=lua_list(load.body_files),
            token=lua_str(load.token),
            content_type=lua_str(load.content_type),
            unique_prefix=lua_str(load.unique_prefix),
            threads=load.threads,
        )
    )
    cmd = ["wrk", "-t", str(load.threads), "-c", str(load.connections), "-d", f"{opts.duration}s"]
    cmd += ["--timeout", "60s", "-s", str(script), f"http://127.0.0.1:{load.port}/"]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    (u0, s0), w0 = group_cpu_seconds(load.pgid), time.perf_counter()
    proc = procs.spawn(cmd, None)
    try:
        out, _ = proc.communicate(timeout=opts.duration + 120)
    finally:
        procs.stop(proc, signal.SIGKILL, timeout=10)
    wall = time.perf_counter() - w0
    u1, s1 = group_cpu_seconds(load.pgid)
    srv_cpu = (u1 - u0) + (s1 - s0)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = out.decode(errors="replace")
    line = next((x for x in text.splitlines() if x.startswith("WRK_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (status {proc.returncode}) in phase {load.name}:\n{text[-3000:]}")
    doc = json.loads(line.removeprefix("WRK_JSON "))
    dur = doc["duration_us"] / 1e6
    reqs = int(doc["requests"])
    errs = doc["errors"]
    bad = int(errs["status"] + errs["read"] + errs["write"] + errs["timeout"] + errs["connect"])
    ok = max(0, reqs - int(errs["status"]))
    lat = doc["latency_us"]
    client_cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    figs: Figures = {
        "duration_s": dur,
        "requests": reqs,
        "errors": bad,
        "rps": reqs / dur,
        "wire_bytes_in": doc["bytes"],
        "p50_ms": lat["p50"] / 1e3,
        "p90_ms": lat["p90"] / 1e3,
        "p99_ms": lat["p99"] / 1e3,
        "p999_ms": lat["p99.9"] / 1e3,
        "mean_ms": lat["mean"] / 1e3,
        "max_ms": lat["max"] / 1e3,
        "server_cpu_s": srv_cpu,
        "server_cpu_user_s": u1 - u0,
        "server_cpu_system_s": s1 - s0,
        "server_cpu_cores": srv_cpu / wall,
        "server_cpu_ms_per_request": 1e3 * srv_cpu / reqs if reqs else float("nan"),
        "client_cpu_cores": client_cpu / wall,
    }
    for k, v in errs.items():
        figs[f"errors_{k}"] = v
    if load.body_size:
        figs["gbps"] = ok * load.body_size / dur / GB
    figs["wire_gbps"] = doc["bytes"] / dur / GB  # what the server sent, headers included
    if bad:
        print(f"  WARNING: {load.name}: {bad} failed requests ({errs})", flush=True)
    return figs


# -- one worker count -------------------------------------------------------------------------


@dataclass
class Run:
    opts: Options
    root: Path
    procs: Processes
    data: DataSet
    kv: Kvstore
    nginx: Nginx | None
    nginx_skip: str | None
    loaded: bool = False
    load_info: dict[str, Any] = field(default_factory=dict)
    nonce: str = field(default_factory=lambda: os.urandom(4).hex())

    def workdir(self, workers: int) -> Path:
        d = self.root / f"wrk-w{workers}"
        d.mkdir(exist_ok=True)
        return d

    def load_once(self) -> None:
        """Tenants and blocks, the first time a daemon is up (the store keeps them)."""
        if self.loaded:
            return
        size = len(self.data.keys) * self.opts.block_size
        for policy in ("sealed", "direct"):
            self.kv.create_tenant(policy, policy)
            secs = load_tenant(self.kv, policy, self.data)
            self.load_info[policy] = {"seconds": secs, "gbps": size / secs / GB}
            print(
                f"loaded {len(self.data.keys)} blocks into the {policy} tenant by PUT in {secs:.2f} s "
                f"({size / secs / GB:.2f} GB/s, 4 connections)",
                flush=True,
            )
        if self.nginx is not None:
            self.nginx.write_files(self.data)
        self.loaded = True

    def measure(self, workers: int) -> dict[str, Any]:
        """Every phase for one worker count; {"available": False, "reason"} if the daemon refuses it."""
        print(f"\n== workers = {workers}", flush=True)
        try:
            self.kv.start(workers)
        except Unavailable as e:
            print(f"kvstore --workers {workers}: not available ({e})", flush=True)
            return {"available": False, "reason": str(e)}
        try:
            self.load_once()
            nginx_up = False
            if self.nginx is not None:
                self.nginx.start(workers)
                nginx_up = True
            t0 = time.perf_counter()
            for policy in ("sealed", "direct"):
                verify_peer(self.kv.port, self.kv.tokens[policy], "/v1/blocks/", self.data, self.opts.range_size)
            if nginx_up and self.nginx is not None:
                verify_peer(self.nginx.port, "", "/blk/", self.data, self.opts.range_size)
            print(f"verified every block and one range of each, on every peer ({time.perf_counter() - t0:.1f} s)")
            res: dict[str, Any] = {"available": True, "kvstore_pid": self.kv.pgid}
            for ph in self.opts.phases:
                res[ph] = getattr(self, f"phase_{ph}")(workers)
            return res
        finally:
            if self.nginx is not None:
                self.nginx.stop()
            self.kv.stop()

    def _peer_loads(self, workers: int, kind: str) -> list[tuple[str, Load]]:
        o, d = self.opts, self.data
        n = len(d.keys)
        if kind == "range":
            # Key i with offset number (5i + i//n): the offsets vary per key and per round.
            count = n * 4
            sel = [(i % n, d.offsets[(5 * i + i // n) % len(d.offsets)]) for i in range(count)]
            rel = [d.keys[k] for k, _ in sel]
            ranges = [f"bytes={off}-{off + o.range_size - 1}" for _, off in sel]
            body = o.range_size
        else:
            rel, ranges, body = list(d.keys), [], o.block_size
        # "sealed hot": the same requests over the first HOT_BLOCKS blocks only,
        # which fit in the daemon's decoded-blocks cache (decoded_cache_bytes).
        hot = set(d.keys[:HOT_BLOCKS])
        hot_sel = [i for i, k in enumerate(rel) if k in hot]
        loads: list[tuple[str, Load]] = []
        # "records": the sealed tenant's blocks as stored (GET /v1/records), for a
        # client that decodes them itself: the daemon neither decrypts nor decompresses.
        for peer, policy, route in (
            ("sealed", "sealed", "/v1/blocks/"),
            ("sealed hot", "sealed", "/v1/blocks/"),
            ("records", "sealed", "/v1/records/"),
            ("direct", "direct", "/v1/blocks/"),
        ):
            paths = [route + k for k in rel]
            peer_ranges = ranges
            if peer == "sealed hot":
                paths = [paths[i] for i in hot_sel]
                peer_ranges = [ranges[i] for i in hot_sel] if ranges else []
            loads.append(
                (
                    peer,
                    Load(
                        f"w{workers}-{kind}-{peer.replace(' ', '-')}",
                        self.kv.port,
                        self.kv.pgid,
                        paths=paths,
                        ranges=peer_ranges,
                        token=self.kv.tokens[policy],
                        body_size=body,
                        connections=o.connections,
                        threads=o.threads,
                    ),
                )
            )
        if self.nginx is not None and self.nginx.proc is not None:
            loads.append(
                (
                    "nginx",
                    Load(
                        f"w{workers}-{kind}-nginx",
                        self.nginx.port,
                        self.nginx.pgid,
                        paths=["/blk/" + k for k in rel],
                        ranges=ranges,
                        body_size=body,
                        connections=o.connections,
                        threads=o.threads,
                    ),
                )
            )
        return loads

    def _get_like(self, workers: int, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for peer, load in self._peer_loads(workers, kind):
            figs = run_wrk(load, self.opts, self.workdir(workers), self.procs)
            out[peer] = figs
            print(f"  {kind:<6} {peer:<7} {line_summary(figs)}", flush=True)
        if "nginx" not in out:
            out["nginx_skipped"] = self.nginx_skip or "nginx is not running"
        nginx = out.get("nginx")
        if isinstance(nginx, dict) and nginx.get("gbps"):
            for policy in ("sealed", "sealed hot", "direct"):
                out[policy]["vs_nginx"] = out[policy]["gbps"] / nginx["gbps"]
            # The daemon's bytes per second (stored, compressed frames) against nginx's.
            out["records"]["vs_nginx"] = out["records"]["wire_gbps"] / nginx["wire_gbps"]
        if out["direct"].get("gbps"):
            out["sealed hot"]["vs_direct"] = out["sealed hot"]["gbps"] / out["direct"]["gbps"]
        if kind == "range":
            frame = 1 * MiB
            offs = self.data.offsets
            cross = sum(1 for x in offs if x // frame != (x + self.opts.range_size - 1) // frame)
            out["offsets"] = {
                "count": len(offs),
                "alignment": 4 * KiB,
                "crossing_a_1MiB_frame_boundary": cross / len(offs),
            }
        return out

    def phase_get(self, workers: int) -> dict[str, Any]:
        return self._get_like(workers, "get")

    def phase_range(self, workers: int) -> dict[str, Any]:
        return self._get_like(workers, "range")

    def phase_put(self, workers: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        bodies = []
        for j, b in enumerate(self.data.distinct):
            p = self.root / f"body-{j}.bin"
            if not p.exists():
                p.write_bytes(b)
            bodies.append(str(p))
        for policy in ("sealed", "direct"):
            tenant = f"put-{policy}-w{workers}-{self.nonce}"
            token = self.kv.create_tenant(tenant, policy)
            try:
                load = Load(
                    f"w{workers}-put-{policy}",
                    self.kv.port,
                    self.kv.pgid,
                    method="PUT",
                    body_files=bodies,
                    token=token,
                    unique_prefix=f"put-{self.nonce}-",
                    body_size=self.opts.block_size,
                    connections=self.opts.connections,
                    threads=self.opts.threads,
                )
                figs = run_wrk(load, self.opts, self.workdir(workers), self.procs)
                st = Client(self.kv.port, token)
                try:
                    stats = st.request("GET", "/v1/stats").json()
                finally:
                    st.close()
                figs["blocks_stored"] = stats["blocks"]  # == successful requests: every key was new
                figs["bytes_stored"] = stats["bytes_stored"]
            finally:
                self.kv.delete_tenant(tenant)  # frees the disk for the next phase
            out[policy] = figs
            print(f"  put    {policy:<7} {line_summary(figs)}; {figs['blocks_stored']:.0f} blocks stored", flush=True)
        return out

    def phase_lookup(self, workers: int) -> dict[str, Any]:
        d, o = self.data, self.opts
        n = len(d.keys)
        starts = sorted({(j * 37) % n for j in range(min(n, 64))})
        chains = [[d.keys[(s + i) % n] for i in range(o.chain)] for s in starts]
        body_files = []
        for j, ch in enumerate(chains):
            p = self.root / f"lookup-{j}.json"
            p.write_text(json.dumps({"keys": ch}))
            body_files.append(str(p))
        out: dict[str, Any] = {"chain": o.chain, "distinct_chains": len(chains), "tenant": "sealed"}
        for label, conns, threads in (("conns", o.connections, o.threads), ("1conn", 1, 1)):
            load = Load(
                f"w{workers}-lookup-{label}",
                self.kv.port,
                self.kv.pgid,
                method="POST",
                paths=["/v1/lookup"] * len(chains),
                body_files=body_files,
                token=self.kv.tokens["sealed"],
                content_type="application/json",
                connections=conns,
                threads=threads,
            )
            figs = run_wrk(load, o, self.workdir(workers), self.procs)
            figs["connections"] = conns
            out[label] = figs
            print(f"  lookup {conns} conn{'s' if conns > 1 else ''}: {line_summary(figs)}", flush=True)
        out["1conn_bulk"] = self._lookup_beside_bulk(workers, body_files, len(chains))
        return out

    def _lookup_beside_bulk(self, workers: int, body_files: list[str], chains: int) -> Figures:
        """Lookups at one connection while ``-c`` connections stream whole
        2 MiB direct GETs (started first, ending after): a control call's
        latency behind bulk transfers. The server CPU figures of this row
        cover both loads."""
        o = self.opts
        bulk = Load(
            f"w{workers}-lookup-bulk",
            self.kv.port,
            self.kv.pgid,
            paths=["/v1/blocks/" + k for k in self.data.keys],
            token=self.kv.tokens["direct"],
            body_size=o.block_size,
            connections=o.connections,
            threads=o.threads,
        )
        lookups = Load(
            f"w{workers}-lookup-1conn-bulk",
            self.kv.port,
            self.kv.pgid,
            method="POST",
            paths=["/v1/lookup"] * chains,
            body_files=body_files,
            token=self.kv.tokens["sealed"],
            content_type="application/json",
            connections=1,
            threads=1,
        )
        longer = dataclasses.replace(o, duration=o.duration + 2)
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(run_wrk, bulk, longer, self.workdir(workers), self.procs)
            time.sleep(1.0)  # the GETs are streaming before the first lookup
            figs = run_wrk(lookups, o, self.workdir(workers), self.procs)
            bulk_figs = streaming.result()
        figs["connections"] = 1
        figs["bulk_gbps"] = bulk_figs.get("gbps", 0.0)
        figs["bulk_rps"] = bulk_figs["rps"]
        print(f"  lookup 1 conn beside {o.connections} conns of GETs: {line_summary(figs)}", flush=True)
        print(f"    the GETs meanwhile: {line_summary(bulk_figs)}", flush=True)
        return figs


def line_summary(f: Figures) -> str:
    gb = f"{f['gbps']:.3f} GB/s, " if "gbps" in f else ""
    return (
        f"{gb}{f['rps']:.0f} req/s, p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms, "
        f"server CPU {f['server_cpu_cores']:.2f} cores ({f['server_cpu_ms_per_request']:.2f} ms/req), "
        f"wrk {f['client_cpu_cores']:.2f} cores"
    )


# -- output --------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("ok" if ok else "MISS")


def targets_of(res: dict[str, Any], connections: int) -> dict[str, dict[str, Any]]:
    """The targets for one worker count: value, target, met."""
    out: dict[str, dict[str, Any]] = {}
    get = res.get("get", {})
    for policy, lo in (("direct", 1.0), ("sealed", 0.6), ("records", 1.0)):
        v = get.get(policy, {}).get("vs_nginx")
        out[f"{policy} GET / nginx"] = {"value": v, "target": f">= {lo}x", "met": None if v is None else v >= lo}
    rng = res.get("range", {})
    d, n = rng.get("direct", {}).get("server_cpu_ms_per_request"), rng.get("nginx", {}).get("server_cpu_ms_per_request")
    lookups = res.get("lookup", {})
    for name, v, bound, at_least in (
        ("direct Range / nginx", rng.get("direct", {}).get("vs_nginx"), 0.9, True),
        ("direct Range CPU/req / nginx", None if not d or not n else d / n, 2.0, False),
        ("sealed hot GET / direct", get.get("sealed hot", {}).get("vs_direct"), 0.8, True),
        ("sealed hot Range / nginx", rng.get("sealed hot", {}).get("vs_nginx"), 0.5, True),
    ):
        met = None if v is None else (v >= bound if at_least else v <= bound)
        out[name] = {"value": v, "target": f"{'>=' if at_least else '<='} {bound}x", "met": met}
    for name, figs in (
        (f"lookup p99 ({connections} conns)", lookups.get("conns")),
        (f"lookup p99 (1 conn, {connections} conns of GETs)", lookups.get("1conn_bulk")),
    ):
        v = None if figs is None else figs["p99_ms"]
        met = None if v is None else v < LOOKUP_P99_TARGET_MS
        out[name] = {"value": v, "target": f"< {LOOKUP_P99_TARGET_MS:g} ms", "met": met}
    return out


def render(results: dict[str, Any], opts: Options) -> str:
    out: list[str] = []
    cols = ["GB/s", "req/s", "p50 ms", "p99 ms", "srv cores", "srv ms/req", "wrk cores", "vs nginx", "target"]
    widths = [8, 9, 9, 9, 10, 11, 10, 9, 16]

    def row(phase: str, peer: str, cells: Sequence[str]) -> str:
        return f"  {phase:<16}{peer:<18}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))

    def cells(f: Figures, target: str = "") -> list[str]:
        vs = f.get("vs_nginx")
        return [
            fmt(f.get("gbps"), ".3f"),
            fmt(f["rps"], ".0f"),
            fmt(f["p50_ms"], ".2f"),
            fmt(f["p99_ms"], ".2f"),
            fmt(f["server_cpu_cores"], ".2f"),
            fmt(f["server_cpu_ms_per_request"], ".2f"),
            fmt(f["client_cpu_cores"], ".2f"),
            "-" if vs is None else f"{vs:.2f}x",
            target,
        ]

    for w in opts.workers:
        res = results[f"w{w}"]
        out.append("")
        conns = f"wrk -t {opts.threads} -c {opts.connections} -d {opts.duration}s"
        if not res.get("available"):
            out.append(f"workers = {w}: not available ({res.get('reason')})")
            continue
        with_nginx = [ph for ph in ("get", "range") if ph in res]
        nginx_ran = any("nginx" in res[ph] for ph in with_nginx)
        ng = f", nginx worker_processes {w}" if nginx_ran else (", nginx skipped" if with_nginx else "")
        out.append(f"workers = {w} (kvstore --workers {w}{ng}); {conns}")
        out.append(row("", "", cols))
        tg = targets_of(res, opts.connections)
        size = f"{opts.block_size / MiB:g} MiB"
        rsize = f"{opts.range_size / KiB:g} KiB"
        for ph, label in (("get", f"GET {size}"), ("range", f"Range {rsize}")):
            if ph not in res:
                continue
            first = True
            for peer in PEERS_GET:
                f = res[ph].get(peer)
                name = f"kvstore {peer}" if peer != "nginx" else "nginx sendfile"
                if f is None:
                    out.append(row(label if first else "", name, ["skipped"] + [""] * 8))
                else:
                    target = ""
                    name_t = {"get": f"{peer} GET / nginx", "range": f"{peer} Range / nginx"}[ph]
                    if name_t in tg:
                        t = tg[name_t]
                        target = f"{t['target']} {verdict(t['met'])}"
                    out.append(row(label if first else "", name, cells(f, target)))
                first = False
        if "put" in res:
            for i, policy in enumerate(("sealed", "direct")):
                out.append(row(f"PUT {size}" if i == 0 else "", f"kvstore {policy}", cells(res["put"][policy])))
        if "lookup" in res:
            lk = res["lookup"]
            t = tg[f"lookup p99 ({opts.connections} conns)"]
            out.append(
                row(
                    f"lookup {opts.chain} keys",
                    f"sealed, {opts.connections} conns",
                    cells(lk["conns"], f"p99 {t['target']} {verdict(t['met'])}"),
                )
            )
            out.append(row("", "sealed, 1 conn", cells(lk["1conn"])))
            t = tg[f"lookup p99 (1 conn, {opts.connections} conns of GETs)"]
            out.append(row("", "1 conn beside GETs", cells(lk["1conn_bulk"], f"p99 {t['target']} {verdict(t['met'])}")))
    out.append("")
    out.append("Targets")
    head = "".join(f"{'workers=' + str(w):>18}" for w in opts.workers)
    out.append(f"  {'':<34}{'target':>12}{head}")
    for name, target in TARGETS.items():
        key = name.replace("CONNECTIONS", str(opts.connections))
        vals = ""
        for w in opts.workers:
            res = results[f"w{w}"]
            if not res.get("available"):
                vals += f"{'n/a':>18}"
                continue
            t = targets_of(res, opts.connections)[key]
            v = t["value"]
            shown = "-" if v is None else (f"{v:.2f} ms" if "ms" in t["target"] else f"{v:.2f}x")
            vals += f"{shown if v is None else shown + ' ' + verdict(t['met']):>18}"
        out.append(f"  {key:<34}{target:>12}{vals}")
    out.append("")
    out.append("  GB/s: 1e9 body bytes/s of successful requests (PUT: request bodies). srv cores / srv ms/req: CPU of")
    out.append("  the server's processes (all workers) per wall second / per request. wrk cores: the load generator's.")
    return "\n".join(out)


def json_doc(
    opts: Options, data: DataSet, run: Run | None, results: dict[str, Any], fs: tuple[str, str, str], skipped: list[str]
) -> dict[str, Any]:
    return {
        "benchmark": "kvstore http_bench",
        "units": {
            "gbps": "1e9 body bytes per second (PUT: request bodies)",
            "*_ms": "milliseconds (wrk latency)",
            "server_cpu_cores": "server processes' CPU s / wall s",
            "server_cpu_ms_per_request": "server CPU ms per request",
        },
        "notes": NOTES,
        "options": {
            "blocks": opts.blocks,
            "block_size": opts.block_size,
            "range_size": opts.range_size,
            "lookup_chain": opts.chain,
            "duration_s": opts.duration,
            "connections": opts.connections,
            "threads": opts.threads,
            "workers": opts.workers,
            "phases": opts.phases,
            "durability": opts.durability,
            "samples": str(opts.samples),
            "quick": opts.quick,
        },
        "data": {"distinct_blocks": len(data.distinct), "sample_files": data.sources, "range_offsets": data.offsets},
        "environment": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "tmp_fs": {"mount": fs[0], "type": fs[1], "device": fs[2]},
            "loadavg_end": os.getloadavg(),
            "nginx": str(NGINX) if NGINX.exists() else None,
            "wrk": shutil.which("wrk"),
        },
        "skipped": skipped,
        "load": run.load_info if run is not None else {},
        "targets": {
            f"w{w}": targets_of(results[f"w{w}"], opts.connections)
            for w in opts.workers
            if results.get(f"w{w}", {}).get("available")
        },
        "results": results,
    }


# -- main -------------------------------------------------------------------------------------


def execute(opts: Options, json_path: Path | None) -> int:
    skipped: list[str] = []
    if shutil.which("wrk") is None:
        msg = f"wrk is not installed: nothing to measure (install: {INSTALL_HINT})"
        print(f"http_bench: skipped: {msg}")
        return 0
    nginx_skip: str | None = None
    if not NGINX.exists():
        nginx_skip = f"{NGINX} is missing: nginx skipped, no ratios (install: {INSTALL_HINT})"
        print(f"http_bench: {nginx_skip}")
        skipped.append(nginx_skip)
    data = make_dataset(opts)
    base = opts.base if opts.base is not None else default_base_dir()
    base.mkdir(parents=True, exist_ok=True)
    need = (3 * opts.blocks + 16) * opts.block_size
    if shutil.disk_usage(base).free < need * 1.5 + 4 * 1024 * MiB:
        raise ValueError(f"{base} has {shutil.disk_usage(base).free / MiB:.0f} MiB free; this needs ~{need / MiB:.0f}+")
    fs = mount_of(base)
    root = Path(tempfile.mkdtemp(prefix="kvstore-http-bench-", dir=base))
    procs = Processes()
    results: dict[str, Any] = {}
    run: Run | None = None
    print(
        f"kvstore HTTP benchmark: {opts.blocks} blocks of {opts.block_size / MiB:g} MiB per tenant "
        f"(sealed, direct) and for nginx; wrk -t {opts.threads} -c {opts.connections} -d {opts.duration}s per phase; "
        f"workers {','.join(map(str, opts.workers))}; phases {','.join(opts.phases)}; durability {opts.durability}"
    )
    print(f"temp dir: {root} ({fs[1]} on {fs[2]}, mounted at {fs[0]})")
    if fs[1] in MEMORY_FS:
        print(f"WARNING: {root} is on {fs[1]} (memory), not a disk")
    print(
        f"samples: {opts.samples}: {len(data.distinct)} distinct blocks "
        f"({', '.join(f'{f} x{c}' for f, c in data.sources.items())}), reused round-robin under distinct keys"
    )
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    try:
        kv = Kvstore(procs, root, opts.durability)
        nginx = Nginx(procs, root) if nginx_skip is None else None
        run = Run(opts, root, procs, data, kv, nginx, nginx_skip)
        for w in opts.workers:
            results[f"w{w}"] = run.measure(w)
        print(render(results, opts))
    finally:
        procs.stop_all()
        if opts.keep:
            print(f"kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    print(f"\nload average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(json_doc(opts, data, run, results, fs, skipped), indent=1) + "\n")
        print(f"wrote {json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        opts = build_options(a)
        with sigterm_as_exit():
            return execute(opts, a.json)
    except ValueError as e:
        print(f"http_bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("http_bench: interrupted; servers stopped, temp dir removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
