"""Shared fixtures: a real store on a real temporary directory, and a real S3
endpoint (moto's server on 127.0.0.1) with dummy credentials."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from kvstore.config import StoreConfig
from kvstore.engine.crypto import MasterKey
from kvstore.engine.store import Store

from .moto_s3 import REGION, MotoEndpoint, S3Env

KV_DIR = Path(__file__).resolve().parents[1] / "bench" / "data" / "kv"
HANG_REPORT_MARGIN_S = 20  # before pytest-timeout's limit: what every asyncio task awaits


def _main_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop the main thread runs, found on its stack."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, asyncio.AbstractEventLoop):
            return owner
        frame = frame.f_back
    return None


def _report_tasks() -> None:
    loop = _main_loop()
    if loop is None or loop.is_closed():
        return

    def dump() -> None:
        print("\n==== asyncio tasks of a test close to its time limit ====", file=sys.stderr)
        for task in asyncio.all_tasks(loop):
            print(f"-- {task!r}", file=sys.stderr)
            task.print_stack(limit=30, file=sys.stderr)
        sys.stderr.flush()

    loop.call_soon_threadsafe(dump)


@pytest.fixture(autouse=True)
def _hang_report(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that hangs in asyncio shows what each task awaits (pytest-timeout
    dumps threads only, and an idle loop's thread says nothing)."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if limit <= HANG_REPORT_MARGIN_S:
        yield
        return
    timer = threading.Timer(limit - HANG_REPORT_MARGIN_S, _report_tasks)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def kv_sample(name: str) -> bytes:
    """A real KV-cache slice (see bench/data/kv/README.md)."""
    return (KV_DIR / name).read_bytes()


@pytest.fixture
def master() -> MasterKey:
    return MasterKey(os.urandom(32))


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def config(data_dir: Path) -> StoreConfig:
    """Small segments and frames so that tests cross segment and frame boundaries."""
    return StoreConfig.from_env(data_dir, env={}, segment_size="1MiB", frame_size="64KiB", max_block_size="4MiB")


OpenStore = Callable[..., Awaitable[Store]]


@pytest.fixture
async def open_store(config: StoreConfig, master: MasterKey) -> AsyncIterator[OpenStore]:
    """Open stores on the test's data directory; all are closed at the end."""
    opened: list[Store] = []

    async def _open(cfg: StoreConfig | None = None, key: MasterKey | None = None, **changes: Any) -> Store:
        c = (cfg or config).with_(**changes) if changes else (cfg or config)
        s = await Store.open(c, key or master)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        await s.close()


@pytest.fixture
async def store(open_store: OpenStore) -> Store:
    s = await open_store()
    await s.create_tenant("alice")
    await s.create_tenant("bob")
    await s.create_tenant("direct", "direct")
    return s


@pytest.fixture(scope="session")
def aws_env() -> Iterator[None]:
    """Dummy credentials from the standard variables; no metadata service, no
    profile or config file of the machine's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", REGION)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", "/dev/null")
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="session")
def s3(aws_env: None) -> Iterator[S3Env]:
    endpoint = MotoEndpoint()
    endpoint.start()
    bucket = f"kvstore-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint.url, region_name=REGION)
    client.create_bucket(Bucket=bucket)
    client.close()
    try:
        yield S3Env(endpoint, bucket)
    finally:
        endpoint.stop()
