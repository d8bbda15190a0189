"""kvstore-bench fleet: how long a fleet takes to serve a dead node's blocks,
and how fast the survivors serve them.

Starts moto's S3 server and ``--nodes`` daemons on 127.0.0.1 as a fleet on
one bucket (docs/fleet.md). Then:

1. A fleet client writes ``--blocks`` blocks and every node flushes them
   to the bucket.
2. The bench measures reads of node-1's blocks on node-1 itself
   (``get_many`` through the client, ``--rounds`` rounds).
3. It kills node-1 with SIGKILL and records two times:
   - until a survivor declares node-1 dead;
   - until every one of node-1's blocks reads back byte-exact through the
     client: full takeover;
   and prints each survivor's own ``kvstore_fleet_takeover_seconds`` (from
   its seeing node-1 dead to serving its blocks).
4. It reads node-1's blocks again, now from the survivors (ranged GETs on
   the bucket).

Membership is in the bucket, or on an etcd the operator runs
(``--etcd-url``: the nodes' ``fleet_etcd_url``).

Figures are medians of the rounds, and the throughput is given against the
same blocks read on their own node. moto is a Python S3 server on the same
2 cores, so the survivors' figure is a floor, not what a real object store
gives. Example::

    .venv/bin/kvstore-bench fleet --blocks 200 --block-size 256KiB --json fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore.config import parse_size

from . import moto_s3
from .daemon import Kvstore, Unavailable
from .harness import Processes, free_port, free_ports

PROG = "kvstore-bench fleet"
MOTO = "moto[server]>=5"  # as pyproject.toml's test and bench extras name it
MOTO_HINT = f"pip install '{MOTO}'"


def missing_moto(importer: Callable[[str], object] = importlib.import_module, prog: str = PROG) -> str:
    """Nothing ("") if moto's S3 server imports; else one line, after ``prog``:
    the missing module and the command that installs it with this
    interpreter's pip (the environment that runs the bench is the one that
    needs it). moto without its ``server`` extra imports, its server does not
    (no flask): the server's module is what is tried."""
    try:
        importer("moto.server")
    except ImportError as e:
        missing = getattr(e, "name", None) or "moto.server"
        return (
            f"{prog}: needs moto's S3 server (no module {missing!r}); install it with: "
            f"{sys.executable} -m pip install '{MOTO}'"
        )
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=f"Needs moto's S3 server ({MOTO_HINT}).",
    )
    p.add_argument("--nodes", type=int, default=3, help="daemons in the fleet (default 3)")
    p.add_argument("--blocks", type=int, default=300, help="blocks written (default 300)")
    p.add_argument("--block-size", default="256KiB", help="bytes per block (default 256KiB)")
    p.add_argument(
        "--policy", choices=("sealed", "direct"), default="sealed", help="the tenant's policy (default sealed)"
    )
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="fleet_heartbeat_s (default 1)")
    p.add_argument("--dead-after-s", type=float, default=3.0, help="fleet_dead_after_s (default 3)")
    p.add_argument(
        "--etcd-url", default="", help="membership on this etcd (fleet_etcd_url) instead of the bucket (default)"
    )
    p.add_argument("--rounds", type=int, default=3, help="read rounds per measurement (default 3)")
    p.add_argument("--workers", type=int, default=2, help="worker processes per node (default 2)")
    p.add_argument(
        "--changes", type=int, default=5, help="tenant changes timed across the fleet, each kind (default 5)"
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        a.size = parse_size("--block-size", a.block_size)
    except Exception as e:  # noqa: BLE001 - argparse's error, with the parser's message
        p.error(str(e))
    if a.nodes < 2 or a.blocks < a.nodes or a.rounds < 1 or not 1 <= a.size <= 64 << 20:
        p.error("--nodes >= 2, --blocks >= --nodes, --rounds >= 1, --block-size 1 B to 64 MiB")
    if a.workers < 1 or a.changes < 0:
        p.error("--workers >= 1, --changes >= 0")
    if a.dead_after_s < 2 * a.heartbeat_s:
        p.error("argument --dead-after-s: at least twice --heartbeat-s")
    return a


def _call(base: str, method: str, path: str, token: str, doc: Any = None) -> tuple[int, Any]:
    req = urllib.request.Request(base + path, data=None if doc is None else json.dumps(doc).encode(), method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return r.status, json.loads(body) if body else None
    except urllib.error.HTTPError as e:
        return e.code, None
    except OSError:
        return 0, None


def _metric(base: str, token: str, series: str) -> float | None:
    """One series of ``base``'s /metrics (None: not there)."""
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == series:
            return float(value)
    return None


def _until(what: str, check: Any, timeout: float, prog: str = PROG) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"{prog}: not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


class Fleet:
    """``nodes`` daemons (bench/daemon.py's :class:`Kvstore`) sharing a master
    key and an admin token, each on a port chosen before any starts (its
    advertised URL), with its data and log in ``root``/n<i>. ``workers`` per
    node (None: the daemon's, or a ``workers`` of ``settings``); ``settings``:
    more KVSTORE_<NAME> variables of every node, over the fleet's own;
    ``flags``: of every node's ``kvstore serve``."""

    def __init__(
        self,
        nodes: int,
        root: Path,
        s3_url: str,
        bucket: str,
        *,
        workers: int | None = 2,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 3.0,
        etcd_url: str = "",
        settings: Mapping[str, str] | None = None,
        flags: Sequence[str] = (),
    ) -> None:
        self.admin = secrets.token_hex(16)
        key = root / "master.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        self.procs = Processes()
        self.workers = workers
        self.flags = list(flags)
        self.ports = free_ports(nodes)
        self.bases = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.nodes: list[Kvstore] = []
        for i, base in enumerate(self.bases):
            (root / f"n{i}").mkdir()
            node = Kvstore(self.procs, root / f"n{i}", admin_token=self.admin, key_file=key, pass_env=())
            node.env |= {
                "KVSTORE_FLEET": "1",
                "KVSTORE_NODE_ID": f"node-{i}",
                "KVSTORE_ADVERTISE_URL": base,
                "KVSTORE_FLEET_HEARTBEAT_S": str(heartbeat_s),
                "KVSTORE_FLEET_DEAD_AFTER_S": str(dead_after_s),
                "KVSTORE_S3_REFRESH_S": "1",
                "KVSTORE_S3_BUCKET": bucket,
                "KVSTORE_S3_ENDPOINT": s3_url,
                "KVSTORE_S3_PREFIX": "bench",  # (a new bucket per run: a new key prefix on etcd too)
                "KVSTORE_FLEET_ETCD_URL": etcd_url,
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": "/dev/null",
                "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
                **{"KVSTORE_" + k.upper(): v for k, v in (settings or {}).items()},
            }
            self.nodes.append(node)

    def start(self, i: int) -> None:
        self.nodes[i].start(self.workers, self.flags, port=self.ports[i])

    def wait_alive(self, timeout: float, prog: str = PROG) -> None:
        """Until every node sees every node alive (``SystemExit`` after ``timeout``)."""
        n = len(self.nodes)
        for i in range(n):
            alive = lambda i=i: all(self.state(j, f"node-{i}") == "alive" for j in range(n))  # noqa: E731
            _until(f"node-{i} alive", alive, timeout, prog)

    def wait_tenant(self, token: str, timeout: float, prog: str = PROG) -> None:
        """Until every node serves the tenant of ``token`` (``GET /v1/stats`` 200;
        ``SystemExit`` after ``timeout`` on one of them)."""
        for base in self.bases:
            _until(f"the tenant on {base}", lambda b=base: _call(b, "GET", "/v1/stats", token)[0] == 200, timeout, prog)

    def kill(self, i: int) -> None:
        """SIGKILL: the node and its workers, without a word."""
        self.nodes[i].stop(signal.SIGKILL, timeout=30)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(signal.SIGTERM, timeout=30)

    def state(self, at: int, node: str) -> str:
        status, doc = _call(self.bases[at], "GET", "/v1/fleet", self.admin)
        if status != 200:
            return ""
        return next((n["state"] for n in doc["nodes"] if n["id"] == node), "")


@contextlib.contextmanager
def local_fleet(nodes: int, prefix: str, prog: str = PROG, **options: Any) -> Iterator[Fleet]:
    """moto's S3 server in this process (its conditional PUTs atomic, as on
    S3), a new bucket on it, and a :class:`Fleet` of ``nodes`` daemons on that
    bucket (``options``: :class:`Fleet`'s), in a new directory under /var/tmp
    named from ``prefix``; yielded once every node sees every node alive.
    Afterwards the nodes are stopped (SIGTERM), moto too, the directory removed."""
    moto, s3_url = moto_s3.start(free_port())
    try:
        bucket = f"kvstore-fleet-bench-{secrets.token_hex(4)}"
        moto_s3.ensure_bucket(s3_url, bucket)
        root = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
        try:
            fleet = Fleet(nodes, root, s3_url, bucket, **options)
            try:
                for i in range(nodes):
                    try:
                        fleet.start(i)
                    except (RuntimeError, Unavailable) as e:
                        raise SystemExit(f"{prog}: node-{i} did not start: {e}") from e
                fleet.wait_alive(60, prog)
                yield fleet
            finally:
                fleet.stop()
                fleet.procs.stop_all()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        moto.stop()


async def _read_rate(kv: Any, keys: list[str], blocks: dict[str, bytes], rounds: int) -> tuple[float, list[float]]:
    """Median MB/s of get_many over ``keys`` (byte-exact, or the bench stops)."""
    rates = []
    nbytes = sum(len(blocks[k]) for k in keys)
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = await kv.get_many(keys)
        took = time.perf_counter() - t0
        if got != [blocks[k] for k in keys]:
            raise SystemExit("kvstore-bench fleet: a block read back differs")
        rates.append(nbytes / took / 1e6)
    return statistics.median(rates), rates


def _until_all(bases: list[str], check: Any, timeout: float) -> list[float]:
    """Seconds until ``check(base)`` held on each of ``bases`` (polled every 10 ms)."""
    t0 = time.monotonic()
    took: dict[str, float] = {}
    while len(took) < len(bases):
        for b in bases:
            if b not in took and check(b):
                took[b] = time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"kvstore-bench fleet: a tenant change did not reach every node within {timeout} s")
        time.sleep(0.01)
    return [took[b] for b in bases]


def _propagation(a: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    """A tenant created on one node, then its token revoked on another: the
    seconds from each admin call's answer until every other node serves the
    token (GET /v1/stats 200), then refuses it (401). --changes of each."""
    created: list[float] = []
    revoked: list[float] = []
    for r in range(a.changes):
        at, other = r % a.nodes, (r + 1) % a.nodes
        status, doc = _call(
            fleet.bases[at], "POST", "/v1/admin/tenants", fleet.admin, {"name": f"p{r}", "policy": "direct"}
        )
        if status != 201:
            raise SystemExit(f"kvstore-bench fleet: creating tenant p{r} answered {status}")
        token, token_id = doc["token"], doc["token_id"]
        others = [b for i, b in enumerate(fleet.bases) if i != at]
        created += _until_all(others, lambda b, t=token: _call(b, "GET", "/v1/stats", t)[0] == 200, 60)
        path = f"/v1/admin/tenants/p{r}/tokens/{token_id}"
        status, _ = _call(fleet.bases[other], "DELETE", path, fleet.admin)
        if status != 204:
            raise SystemExit(f"kvstore-bench fleet: revoking p{r}'s token answered {status}")
        others = [b for i, b in enumerate(fleet.bases) if i != other]
        revoked += _until_all(others, lambda b, t=token: _call(b, "GET", "/v1/stats", t)[0] == 401, 60)
    out: dict[str, Any] = {"created_s": created, "revoked_s": revoked}
    for name, xs in (("created", created), ("revoked", revoked)):
        if xs:
            out[f"{name}_median_s"], out[f"{name}_max_s"] = statistics.median(xs), max(xs)
            print(
                f"a tenant {name} on one node, in force on the others after: median {statistics.median(xs):.3f} s,"
                f" max {max(xs):.3f} s ({len(xs)} node-changes; heartbeat {a.heartbeat_s} s)",
                flush=True,
            )
    return out


async def _run(a: argparse.Namespace, fleet: Fleet) -> dict[str, Any]:
    from kvstore_client import AsyncClient
    from kvstore_client.sharding import rank_endpoints

    changes = _propagation(a, fleet)
    status, doc = _call(fleet.bases[0], "POST", "/v1/admin/tenants", fleet.admin, {"name": "bench", "policy": a.policy})
    if status != 201:
        raise SystemExit(f"kvstore-bench fleet: creating the tenant answered {status}")
    token = doc["token"]
    fleet.wait_tenant(token, 10)
    blocks = {f"blk-{i:05d}": os.urandom(a.size) for i in range(a.blocks)}
    urls = sorted(fleet.bases)
    victim = fleet.bases[1]
    theirs = [k for k in blocks if rank_endpoints(urls, k)[0] == victim]
    async with AsyncClient(fleet.bases[0], token, fleet=True, fleet_refresh_s=0.2, timeout=30, retries=1) as kv:
        for i in range(0, len(blocks), 64):
            chunk = list(blocks.items())[i : i + 64]
            if not all(await kv.put_many(chunk)):
                raise SystemExit("kvstore-bench fleet: a put failed")
        for base in fleet.bases:
            status, doc = _call(base, "POST", "/v1/admin/flush", fleet.admin)
            if status != 200:
                raise SystemExit(f"kvstore-bench fleet: flush on {base} answered {status}")
        own, own_rounds = await _read_rate(kv, theirs, blocks, a.rounds)
        print(f"node-1's {len(theirs)} blocks read on node-1: {own:.1f} MB/s (median of {a.rounds})", flush=True)
        t_kill = time.monotonic()
        fleet.kill(1)
        _until("node-1 declared dead", lambda: fleet.state(0, "node-1") == "dead", 10 * a.dead_after_s)
        t_dead = time.monotonic() - t_kill
        while True:
            await kv.members()
            if await kv.get_many(theirs) == [blocks[k] for k in theirs]:
                break
            if time.monotonic() - t_kill > 120:
                raise SystemExit("kvstore-bench fleet: no full takeover within 120 s")
            await asyncio.sleep(0.02)
        t_full = time.monotonic() - t_kill
        print(f"killed node-1: declared dead after {t_dead:.2f} s, every block served again after {t_full:.2f} s")
        # Each survivor's own count, from seeing node-1 dead to serving its blocks (kvstore/fleet/takeover.py).
        # One survivor may have served them all before the other finished its own: wait for both (30 s at most).
        survivors = [b for b in fleet.bases if b != victim]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
            _metric(b, fleet.admin, "kvstore_fleet_takeover_seconds_count") for b in survivors
        ):
            time.sleep(0.1)
        takeovers = [_metric(b, fleet.admin, "kvstore_fleet_takeover_seconds_sum") for b in survivors]
        said = ", ".join("-" if t is None else f"{t:.2f} s" for t in takeovers)
        print(f"the survivors' kvstore_fleet_takeover_seconds: {said}")
        via, via_rounds = await _read_rate(kv, theirs, blocks, a.rounds)
        print(f"node-1's blocks read through the survivors: {via:.1f} MB/s ({via / own:.2f} x on their own node)")
    return {
        "nodes": a.nodes,
        "workers": a.workers,
        "tenant_changes": changes,
        "blocks": a.blocks,
        "block_size": a.size,
        "policy": a.policy,
        "heartbeat_s": a.heartbeat_s,
        "dead_after_s": a.dead_after_s,
        "membership": "etcd" if a.etcd_url else "bucket",
        "victim_blocks": len(theirs),
        "declared_dead_s": t_dead,
        "full_takeover_s": t_full,
        "survivors_takeover_s": takeovers,
        "own_node_mb_s": own,
        "own_node_rounds": own_rounds,
        "survivors_mb_s": via,
        "survivors_rounds": via_rounds,
        "survivors_over_own": via / own,
        "s3": "moto (in-process Python S3 server, same machine)",
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    missing = missing_moto()  # before any daemon starts
    if missing:
        print(missing, file=sys.stderr)
        return 2
    options = {"workers": a.workers, "heartbeat_s": a.heartbeat_s, "dead_after_s": a.dead_after_s}
    with local_fleet(a.nodes, "kvstore-fleet-bench-", etcd_url=a.etcd_url, **options) as fleet:
        doc = asyncio.run(_run(a, fleet))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
