"""One conformance suite over every tier backend (kvstore/tier/): a local
directory, and S3 through boto3 against a real moto S3 server. The S3-only
cases at the end inject faults: a dead endpoint, an endpoint that stops and
comes back, and a fake endpoint answering 500s, throttling, denials, slowly."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvstore.errors import (
    InvalidObjectName,
    TierAccessDenied,
    TierConflict,
    TierError,
    TierNotFound,
    TierRangeError,
    TierUnavailable,
)
from kvstore.tier import LocalTier, ObjectInfo, Tier
from kvstore.tier.s3 import S3Tier

from ..moto_s3 import MotoEndpoint, S3Env

MiB = 1 << 20
MakeTier = Callable[[str], Tier]


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_tier(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[MakeTier]:
    """Tiers of the backend under test; ``make_tier(p)`` for two calls with the
    same ``p`` sees the same objects. S3 tiers get a prefix of their own per test,
    small parts (5 MiB, S3's minimum) and small list pages (3)."""
    made: list[Tier] = []
    run = uuid.uuid4().hex[:8]
    s3: S3Env | None = request.getfixturevalue("s3") if backend == "s3" else None

    def make(prefix: str) -> Tier:
        tier: Tier
        if s3 is None:
            tier = LocalTier(tmp_path / "tier" / prefix)
        else:
            tier = S3Tier(
                s3.bucket,
                prefix=f"{run}/{prefix}",
                endpoint_url=s3.url,
                path_style=True,
                multipart_threshold=5 * MiB,
                part_size=5 * MiB,
                list_page_size=3,
                max_attempts=2,
                connect_timeout=2,
                read_timeout=10,
            )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        await tier.close()


@pytest.fixture
def tier(make_tier: MakeTier) -> Tier:
    return make_tier("node")


async def names(tier: Tier, prefix: str = "") -> list[str]:
    return [info.name async for info in tier.list(prefix)]


# -- the conformance suite ---------------------------------------------------------


def test_backends_implement_the_protocol(tier: Tier) -> None:
    assert isinstance(tier, Tier)


async def test_put_bytes_head_and_ranged_reads(tier: Tier) -> None:
    data = os.urandom(10_000)
    await tier.put_bytes("seg/0000000000000001.seg", data)
    info = await tier.head("seg/0000000000000001.seg")
    assert info is not None
    assert (info.name, info.size) == ("seg/0000000000000001.seg", len(data))
    assert info.etag
    assert await tier.read_range("seg/0000000000000001.seg", 0, len(data)) == data
    assert await tier.read_range("seg/0000000000000001.seg", 0, 7) == data[:7]
    assert await tier.read_range("seg/0000000000000001.seg", 4321, 1000) == data[4321:5321]
    assert await tier.read_range("seg/0000000000000001.seg", len(data) - 1, 1) == data[-1:]
    assert await tier.read_range("seg/0000000000000001.seg", len(data), 0) == b""


async def test_put_file_multipart_and_reads_across_parts(tier: Tier, tmp_path: Path, backend: str) -> None:
    data = os.urandom(12 * MiB + 123)  # three 5 MiB parts in the S3 backend
    src = tmp_path / "big.seg"
    src.write_bytes(data)
    await tier.put_file("big.seg", src)
    info = await tier.head("big.seg")
    assert info is not None and info.size == len(data)
    if backend == "s3":
        assert info.etag.endswith("-3"), f"expected a 3-part multipart upload, etag {info.etag}"
    for start, length in [(0, 100), (5 * MiB - 10, 20), (10 * MiB - 1, 2), (5 * MiB - 1, 5 * MiB + 2)]:
        assert await tier.read_range("big.seg", start, length) == data[start : start + length]
    assert await tier.read_range("big.seg", len(data) - 50, 50) == data[-50:]
    assert await tier.read_range("big.seg", 0, len(data)) == data


async def test_small_put_file(tier: Tier, tmp_path: Path) -> None:
    src = tmp_path / "small"
    src.write_bytes(b"hello segment")
    await tier.put_file("small", src)
    assert await tier.read_range("small", 6, 7) == b"segment"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    await tier.put_file("empty", empty)
    info = await tier.head("empty")
    assert info is not None and info.size == 0


async def test_range_past_the_end_is_an_error(tier: Tier) -> None:
    await tier.put_bytes("obj", b"0123456789")
    for start, length in [(9, 2), (10, 1), (0, 11), (100, 5), (11, 0)]:
        with pytest.raises(TierRangeError) as exc:
            await tier.read_range("obj", start, length)
        assert not exc.value.retryable
        assert exc.value.size in (10, -1)
    with pytest.raises(TierError):
        await tier.read_range("obj", -1, 2)
    with pytest.raises(TierError):
        await tier.read_range("obj", 0, -2)


async def test_missing_object(tier: Tier) -> None:
    assert await tier.head("nope") is None
    assert await tier.head("no/such/dir/obj") is None
    for start, length in [(0, 1), (0, 0)]:
        with pytest.raises(TierNotFound) as exc:
            await tier.read_range("nope", start, length)
        assert exc.value.code == "tier_not_found" and not exc.value.retryable


async def test_delete_is_idempotent(tier: Tier) -> None:
    await tier.put_bytes("a/obj", b"x")
    await tier.delete("a/obj")
    assert await tier.head("a/obj") is None
    await tier.delete("a/obj")
    await tier.delete("never/existed")
    assert await names(tier) == []


async def test_overwrite_replaces_whole_object(tier: Tier, tmp_path: Path) -> None:
    await tier.put_bytes("obj", b"first version, long")
    first = await tier.head("obj")
    await tier.put_bytes("obj", b"second")
    second = await tier.head("obj")
    assert first is not None and second is not None
    assert second.size == 6 and second.etag != first.etag
    assert await tier.read_range("obj", 0, 6) == b"second"
    src = tmp_path / "third"
    src.write_bytes(b"third!!")
    await tier.put_file("obj", src)
    assert await tier.read_range("obj", 0, 7) == b"third!!"
    assert await names(tier) == ["obj"]


async def test_list_is_sorted_paginated_and_filtered(tier: Tier) -> None:
    wanted = [f"seg/{i:016x}.seg" for i in range(11)] + ["a.b", "a/b", "a/c/d", "registry.json", "seg-other"]
    await asyncio.gather(*(tier.put_bytes(n, n.encode()) for n in reversed(wanted)))
    infos = [info async for info in tier.list()]
    assert [i.name for i in infos] == sorted(wanted)  # 16 objects: six pages of 3 in S3
    assert all(isinstance(i, ObjectInfo) and i.size == len(i.name) for i in infos)
    assert await names(tier, "seg/") == [f"seg/{i:016x}.seg" for i in range(11)]
    assert await names(tier, "seg/000000000000000a") == ["seg/000000000000000a.seg"]
    assert await names(tier, "seg") == ["seg-other"] + [f"seg/{i:016x}.seg" for i in range(11)]  # "-" < "/"
    assert await names(tier, "a") == ["a.b", "a/b", "a/c/d"]
    assert await names(tier, "a/c/") == ["a/c/d"]
    assert await names(tier, "zzz") == []


async def test_prefixes_isolate_tiers(make_tier: MakeTier) -> None:
    a, a2 = make_tier("a"), make_tier("a2")  # "a" must not be a prefix of "a2"'s objects
    await a.put_bytes("obj", b"from a")
    await a2.put_bytes("obj", b"from a2!")
    await a2.put_bytes("only-a2", b"x")
    assert await names(a) == ["obj"]
    assert await names(a2) == ["obj", "only-a2"]
    assert await a.read_range("obj", 0, 6) == b"from a"
    assert await a.head("only-a2") is None
    await a.delete("obj")
    assert await a2.read_range("obj", 0, 8) == b"from a2!"
    again = make_tier("a2")
    assert await names(again) == ["obj", "only-a2"]


BAD_NAMES = ["", "/abs", "a/../b", "..", ".", "a//b", "a/", "./a", "a b", "a\\b", "é", "x~1.tmp", "a?b", "a" * 1025]


@pytest.mark.parametrize("bad", BAD_NAMES)
async def test_bad_names_are_rejected(tier: Tier, tmp_path: Path, bad: str) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x")
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: tier.put_bytes(bad, b"x"),
        lambda: tier.put_file(bad, src),
        lambda: tier.read_range(bad, 0, 1),
        lambda: tier.head(bad),
        lambda: tier.delete(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidObjectName):
            await call()
    assert await names(tier) == []


async def test_bad_list_prefixes_are_rejected(tier: Tier) -> None:
    for bad in ["/", "../", "a/../", "a b", "a//"]:
        with pytest.raises(InvalidObjectName):
            await names(tier, bad)


async def test_good_names(tier: Tier) -> None:
    good = ["a", "-x_y.z", "seg/0000000000000001.seg", "registry/tenants.json", ".hidden", "a..b", "A/B/C/D"]
    for name in good:
        await tier.put_bytes(name, name.encode())
    assert await names(tier) == sorted(good)


async def test_missing_source_file_is_not_a_missing_object(tier: Tier, tmp_path: Path) -> None:
    with pytest.raises(TierError) as exc:
        await tier.put_file("obj", tmp_path / "does-not-exist")
    assert not isinstance(exc.value, TierNotFound | TierUnavailable)
    with pytest.raises(TierError):
        await tier.put_file("obj", tmp_path)  # a directory
    assert await tier.head("obj") is None


async def test_concurrent_writes_and_reads(tier: Tier) -> None:
    blobs = {f"c/{i:03d}": os.urandom(1000 + i) for i in range(40)}
    await asyncio.gather(*(tier.put_bytes(n, b) for n, b in blobs.items()))
    got = await asyncio.gather(*(tier.read_range(n, 0, len(b)) for n, b in blobs.items()))
    assert got == list(blobs.values())


# -- local directory only ------------------------------------------------------------


async def test_conditional_writes_create_once_and_compare_etags(tier: Tier) -> None:
    assert await tier.get("state.json") is None
    first = await tier.put_if("state.json", b"v1", None)  # create only
    assert await tier.get("state.json") == (b"v1", first)
    with pytest.raises(TierConflict):
        await tier.put_if("state.json", b"v1 again", None)  # it exists now
    second = await tier.put_if("state.json", b"v2", first)
    assert second != first and await tier.get("state.json") == (b"v2", second)
    with pytest.raises(TierConflict):
        await tier.put_if("state.json", b"stale", first)  # written since
    assert (await tier.get("state.json") or (b"", ""))[0] == b"v2"
    await tier.delete("state.json")
    with pytest.raises(TierConflict):
        await tier.put_if("state.json", b"gone", second)  # deleted since
    info = await tier.head("state.json")
    assert info is None


async def test_racing_read_modify_writes_lose_nothing(tier: Tier) -> None:
    """Eight writers each add themselves to one object, reading it, changing
    it and writing it back conditionally, redoing on conflict: every one of
    them is in the result (the pattern of the fleet's registry and members)."""

    async def add(me: str) -> int:
        tries = 0
        while True:
            tries += 1
            got = await tier.get("members")
            body, etag = got if got is not None else (b"", None)
            names = [n for n in body.decode().split(",") if n]
            try:
                await tier.put_if("members", ",".join([*names, me]).encode(), etag)
                return tries
            except TierConflict:
                await asyncio.sleep(0.001 * tries)

    tries = await asyncio.gather(*(add(f"w{i}") for i in range(8)))
    got = await tier.get("members")
    assert got is not None
    assert sorted(got[0].decode().split(",")) == sorted(f"w{i}" for i in range(8))
    assert max(tries) >= 1


async def test_local_writes_leave_no_temp_files_and_skip_in_flight_ones(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "t")
    await tier.put_bytes("d/obj", b"x")
    (tmp_path / "t" / "d" / "obj~abc.tmp").write_bytes(b"half")  # a crashed write
    assert await names(tier) == ["d/obj"]
    assert sorted(p.name for p in (tmp_path / "t" / "d").iterdir()) == ["obj", "obj~abc.tmp"]


async def test_local_io_errors_are_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = LocalTier(tmp_path / "t")
    await tier.put_bytes("obj", b"data")

    def eio(*_: object) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", eio)
    with pytest.raises(TierUnavailable):
        await tier.read_range("obj", 0, 1)

    def eacces(*_: object) -> bytes:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "pread", eacces)
    with pytest.raises(TierError) as exc:
        await tier.read_range("obj", 0, 1)
    assert not exc.value.retryable


# -- S3 only: credentials and faults ---------------------------------------------------


def _fast_tier(url: str, **kw: Any) -> S3Tier:
    opts: dict[str, Any] = {
        "endpoint_url": url,
        "path_style": True,
        "max_attempts": 2,
        "connect_timeout": 0.5,
        "read_timeout": 0.5,
    }
    bucket = kw.pop("bucket", "bucket")
    opts.update(kw)
    return S3Tier(bucket, **opts)


async def test_s3_credentials_from_arguments(s3: S3Env) -> None:
    tier = S3Tier(
        s3.bucket,
        prefix=f"{uuid.uuid4().hex}/creds",
        endpoint_url=s3.url,
        region="eu-west-1",
        path_style=True,
        access_key_id="AKIAEXPLICIT",
        secret_access_key="explicit-secret",
    )
    try:
        await tier.put_bytes("obj", b"x")
        assert await names(tier) == ["obj"]
    finally:
        await tier.close()


async def test_s3_missing_bucket_is_not_retryable(s3: S3Env) -> None:
    tier = S3Tier("no-such-bucket-kvstore", endpoint_url=s3.url, path_style=True)
    try:
        with pytest.raises(TierError) as exc:
            await tier.put_bytes("obj", b"x")
        assert not exc.value.retryable and not isinstance(exc.value, TierNotFound)
    finally:
        await tier.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_s3_endpoint_down_fails_fast_and_retryable(aws_env: None, tmp_path: Path) -> None:
    tier = _fast_tier(f"http://127.0.0.1:{_closed_port()}")
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: tier.put_bytes("obj", b"x"),
        lambda: tier.put_file("obj", src),
        lambda: tier.read_range("obj", 0, 1),
        lambda: tier.head("obj"),
        lambda: tier.delete("obj"),
        lambda: names(tier),
    ]
    try:
        for call in calls:
            began = time.monotonic()
            with pytest.raises(TierUnavailable) as exc:
                await call()
            assert exc.value.retryable and exc.value.code == "tier_unavailable"
            assert time.monotonic() - began < 3
    finally:
        await tier.close()


async def test_s3_endpoint_stops_and_comes_back(aws_env: None, s3: S3Env) -> None:
    endpoint = MotoEndpoint()
    endpoint.start()
    tier = _fast_tier(endpoint.url, bucket=s3.bucket, prefix=f"{uuid.uuid4().hex}/restart")
    try:
        await tier.put_bytes("obj", b"survives")
        endpoint.stop()
        with pytest.raises(TierUnavailable):
            await tier.read_range("obj", 0, 8)
        with pytest.raises(TierUnavailable):
            await tier.put_bytes("other", b"y")
        endpoint.start()  # same port, same moto state
        assert await tier.read_range("obj", 0, 8) == b"survives"
        await tier.put_bytes("other", b"y")
        assert await names(tier) == ["obj", "other"]
    finally:
        await tier.close()
        endpoint.stop()


def _s3_error(status: int, code: str) -> web.Response:
    body = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected</Message></Error>'
    return web.Response(status=status, body=body.encode(), content_type="application/xml")


@pytest.fixture
async def fake_s3() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """An HTTP endpoint that answers every request as ``state`` says:
    ``state["status"]``/``state["code"]`` as an S3 error, after ``state["delay"]`` s.
    ``state["hits"]`` counts requests (retries included)."""
    state: dict[str, Any] = {"status": 500, "code": "InternalError", "delay": 0.0, "hits": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        state["hits"] += 1
        await request.read()
        state.setdefault("log", []).append(f"{request.method} {request.path_qs}")
        if state["delay"]:
            await asyncio.sleep(state["delay"])
        return _s3_error(state["status"], state["code"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (500, "InternalError", TierUnavailable),
        (502, "BadGateway", TierUnavailable),
        (503, "SlowDown", TierUnavailable),
        (429, "TooManyRequests", TierUnavailable),
        (403, "AccessDenied", TierAccessDenied),  # a TierError a retry does not help; start-up stops on it
        (403, "InvalidAccessKeyId", TierAccessDenied),
        (400, "InvalidArgument", TierError),
        (404, "NoSuchKey", TierNotFound),
    ],
)
async def test_s3_http_errors_are_mapped(
    aws_env: None, fake_s3: tuple[str, dict[str, Any]], status: int, code: str, expected: type[TierError]
) -> None:
    url, state = fake_s3
    state.update(status=status, code=code)
    tier = _fast_tier(url, max_attempts=2)
    try:
        with pytest.raises(TierError) as exc:
            await tier.read_range("obj", 0, 10)
        assert type(exc.value) is expected
        assert exc.value.retryable == (expected is TierUnavailable)
        retried = expected is TierUnavailable
        assert state["hits"] == (2 if retried else 1), state.get("log")  # retried exactly the retryable ones
        if status == 500:
            with pytest.raises(expected):
                await tier.put_bytes("obj", b"x")
    finally:
        await tier.close()


async def test_s3_500_on_multipart_upload(aws_env: None, fake_s3: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    url, _state = fake_s3
    src = tmp_path / "big"
    src.write_bytes(os.urandom(6 * MiB))
    tier = _fast_tier(url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    try:
        with pytest.raises(TierUnavailable):
            await tier.put_file("big", src)
    finally:
        await tier.close()


async def test_s3_slow_endpoint_times_out_as_unavailable(aws_env: None, fake_s3: tuple[str, dict[str, Any]]) -> None:
    url, state = fake_s3
    state.update(delay=1.0)
    tier = _fast_tier(url, max_attempts=1, read_timeout=0.3)
    try:
        began = time.monotonic()
        with pytest.raises(TierUnavailable):
            await tier.head("obj")
        assert time.monotonic() - began < 1.5
    finally:
        await tier.close()
