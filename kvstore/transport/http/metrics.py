"""``GET /metrics``: one Prometheus exposition for the whole daemon,
whatever ``--workers`` is.

Each worker of a multi-worker daemon writes a snapshot of its metrics every
``SNAPSHOT_S`` (and on each scrape it answers) into the workers' private
directory (the one holding the writer's socket, mode 0700); the worker that
a scrape lands on merges every snapshot younger than ``STALE_S``: counters
and histograms added up, per-process gauges (requests in flight, buffered
bodies) added up, the store's gauges taken from the writer. Another
worker's counts are at most ``SNAPSHOT_S`` old. ``kvstore_workers`` says
how many processes the answer covers; ``kvstore_build_info{version,commit}`` which
release answers.

``metrics_token`` makes the route require that bearer token (or the admin
token); ``metrics_tenant_labels = false`` sums the per-tenant series over
tenants and drops their ``tenant`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from kvstore import __commit__, __version__
from kvstore.metrics import Metrics, merged
from kvstore.transport.http.appkeys import METRICS, STATE, STORE, config_of
from kvstore.transport.http.auth import require_metrics_token
from kvstore.transport.http.qos import ADMISSION

SNAPSHOT_S = 0.5
STALE_S = 5.0
PER_PROCESS_GAUGES = frozenset(
    {
        "kvstore_http_inflight",
        "kvstore_http_buffered_body_bytes",
        "kvstore_decoded_cache_bytes",
        "kvstore_tenant_queue_depth",
    }
)


def _directory(app: web.Application) -> Path | None:
    sock = app[STATE].get("writer_socket")
    return Path(sock).parent / "metrics" if sock else None


def _own_file(app: web.Application, directory: Path) -> Path:
    # The writer's sorts first: its store gauges are the ones kept.
    rank = "0" if app[STATE]["role"] == "writer" else "1"
    return directory / f"{rank}-{os.getpid()}.json"


def _cache_gauges(app: web.Application) -> None:
    """The decoded-blocks cache's bytes per tenant, this worker's (summed across workers)."""
    if STORE in app:
        m = app[METRICS]
        for tenant, n in app[STORE].decoded.gauges().items():
            m.set("kvstore_decoded_cache_bytes", n, tenant=tenant)


def _write_snapshot(app: web.Application, directory: Path) -> None:
    path = _own_file(app, directory)
    # A temporary name of its own: the periodic snapshot and a /metrics
    # request may write at the same time, on two threads.
    tmp = path.with_name(f"{path.stem}.{threading.get_ident()}.tmp")
    _cache_gauges(app)
    tmp.write_text(json.dumps(app[METRICS].snapshot()))
    tmp.replace(path)


def _read_snapshots(directory: Path) -> list[dict[str, Any]]:
    now = time.time()
    out = []
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):  # a worker gone, or a file being replaced
            if now - path.stat().st_mtime <= STALE_S:
                out.append(json.loads(path.read_text()))
    return out


async def metrics_ctx(app: web.Application) -> AsyncIterator[None]:
    """The release, once; with several workers: this worker's snapshots, every SNAPSHOT_S."""
    app[METRICS].set("kvstore_build_info", 1, version=__version__, commit=__commit__, python=platform.python_version())
    directory = _directory(app)
    if directory is None:
        yield
        return
    directory.mkdir(mode=0o700, exist_ok=True)

    async def loop() -> None:
        while True:
            await asyncio.to_thread(_write_snapshot, app, directory)
            await asyncio.sleep(SNAPSHOT_S)

    task = asyncio.get_running_loop().create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    with contextlib.suppress(OSError):
        _own_file(app, directory).unlink()


def writers_gauges(app: web.Application, *names: str) -> dict[str, float]:
    """On a reader worker: the writer's latest unlabelled values of the
    gauges ``names`` (from its snapshot, at most ``SNAPSHOT_S`` old; {}
    where there is none, or on a process without a workers' directory)."""
    directory = _directory(app)
    if directory is None:
        return {}
    for path in sorted(directory.glob("0-*.json")):
        with contextlib.suppress(OSError, ValueError):
            if time.time() - path.stat().st_mtime <= STALE_S:
                gauges = json.loads(path.read_text())["gauges"]
                return {n: float(v) for n, labels, v in gauges if n in names and not labels}
    return {}


async def whole(app: web.Application) -> Metrics:
    """The whole daemon's metrics: this process's, or with several workers
    every worker's snapshot merged (this one's written first, another's at
    most SNAPSHOT_S old); ``kvstore_workers`` says how many they cover."""
    directory = _directory(app)
    if directory is None:
        app[METRICS].set("kvstore_workers", 1)
        return app[METRICS]
    await asyncio.to_thread(_write_snapshot, app, directory)
    snapshots = await asyncio.to_thread(_read_snapshots, directory)
    out = merged(snapshots, PER_PROCESS_GAUGES)
    out.set("kvstore_workers", len(snapshots))
    return out


async def metrics(request: web.Request) -> web.Response:
    require_metrics_token(request)
    app = request.app
    store = app[STORE]
    m = app[METRICS]
    blocks = stored = logical = 0
    for t in store.tenants():
        s = await store.stats(t["name"])
        blocks, stored, logical = blocks + s.blocks, stored + s.stored_bytes, logical + s.logical_bytes
    m.set("kvstore_blocks", blocks, tier="g3")
    m.set("kvstore_bytes_stored", stored, tier="g3")
    m.set("kvstore_bytes_logical", logical, tier="g3")
    m.set("kvstore_tenants", len(store.tenants()))
    admission = app[ADMISSION]
    m.set("kvstore_http_inflight", admission.inflight)
    m.set("kvstore_http_buffered_body_bytes", admission.budget.used)
    _cache_gauges(app)
    m = await whole(app)
    if not config_of(request).metrics_tenant_labels:
        m = m.without_label("tenant")
    text = m.render()
    return web.Response(
        text=text, content_type="text/plain", charset="utf-8", headers={"X-Content-Type-Options": "nosniff"}
    )
