"""Bad input gets a precise 4xx; the server keeps serving; stored data is unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest
from kvstore_client.wire import batchframe

from tests.http.conftest import Api

GOOD = b"the stored block" * 100


async def _raw(api: Api, request: bytes, read_timeout: float = 5, until_close: bool = False) -> bytes:
    """Send raw bytes on a fresh connection; return what comes back first
    (``until_close``: everything until the server closes)."""
    host, port = api.base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    try:
        read = reader.read() if until_close else reader.read(65536)
        data = await asyncio.wait_for(read, read_timeout)
    finally:
        writer.close()
    return data


async def _intact(api: Api, token: str) -> None:
    async with api.session.get(api.url("/v1/blocks/good"), headers=api.auth(token)) as r:
        assert r.status == 200 and await r.read() == GOOD
    async with api.session.get(api.url("/v1/stats"), headers=api.auth(token)) as r:
        assert (await r.json())["blocks"] == 1


@pytest.fixture
async def token(api: Api) -> str:
    t = await api.tenant("alice")
    async with api.session.put(api.url("/v1/blocks/good"), data=GOOD, headers=api.auth(t)) as r:
        assert r.status == 201
    return t


@pytest.mark.parametrize("key", ["bad%2Fkey", "sp%20ace", "k" * 257, "%C3%A9t%C3%A9", "a%00b"])
async def test_malformed_keys(api: Api, token: str, key: str) -> None:
    for method in ("PUT", "GET", "DELETE"):
        async with api.session.request(method, api.url(f"/v1/blocks/{key}"), data=b"x", headers=api.auth(token)) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_key"
    await _intact(api, token)


async def test_no_length_is_411(api: Api, token: str) -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        yield b"abc"

    async with api.session.put(api.url("/v1/blocks/chunked"), data=chunks(), headers=api.auth(token)) as r:
        assert r.status == 411 and (await r.json())["error"]["code"] == "length_required"
    await _intact(api, token)


async def test_oversized_body_is_413_before_reading(api: Api, token: str) -> None:
    limit = api.config.store.max_block_size
    req = (
        f"PUT /v1/blocks/big HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {limit + 1}\r\n\r\n"
    ).encode()
    resp = await _raw(api, req)  # the body is never sent: the answer must not wait for it
    assert resp.startswith(b"HTTP/1.1 413") and b"block_too_large" in resp
    async with api.session.put(api.url("/v1/blocks/empty"), data=b"", headers=api.auth(token)) as r:
        assert r.status == 400 and "empty" in (await r.json())["error"]["message"]
    await _intact(api, token)


async def test_body_shorter_than_content_length(api: Api, token: str) -> None:
    host, port = api.base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"PUT /v1/blocks/short HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Content-Length: 1000\r\n\r\n".encode()
        + b"x" * 400
    )
    await writer.drain()
    writer.write_eof()  # the client gives up half-way, and waits for the answer
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"invalid_input" in answer and b"400 of 1000" in answer
    async with api.session.head(api.url("/v1/blocks/short"), headers=api.auth(token)) as r:
        assert r.status == 404  # nothing half-written was stored
    await _intact(api, token)


async def test_body_longer_than_content_length(api: Api, token: str) -> None:
    req = (
        f"PUT /v1/blocks/long HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Content-Length: 10\r\n\r\n0123456789EXTRA-GARBAGE-NOT-HTTP\r\n\r\n"
    ).encode()
    resp = await _raw(api, req, until_close=True)
    # The bytes past Content-Length are a malformed next request: a 400 (after
    # the PUT's own answer when the fast lane took the PUT before they were parsed).
    assert b" 400 " in resp
    # The pipelined garbage may cut the PUT short; it must never corrupt it.
    async with api.session.get(api.url("/v1/blocks/long"), headers=api.auth(token)) as r:
        assert r.status == 404 or await r.read() == b"0123456789"
    async with api.session.delete(api.url("/v1/blocks/long"), headers=api.auth(token)) as r:
        assert r.status in (204, 404)  # stored whole, or not at all; nothing else was stored
    await _intact(api, token)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"NOPE",
        batchframe.MAGIC,  # no end marker: truncated
        batchframe.MAGIC + b"\x05\x00abc",  # key cut short
        batchframe.MAGIC + b"\x01\x00/" + (1).to_bytes(8, "little") + b"x" + batchframe.END,  # bad key
        batchframe.MAGIC + b"\x01\x00k" + (0).to_bytes(8, "little") + batchframe.END,  # empty block
        batchframe.MAGIC + b"\x01\x00k" + (10).to_bytes(8, "little") + b"short",  # data cut short
    ],
)
async def test_garbage_batch_framing(api: Api, token: str, body: bytes) -> None:
    async with api.session.post(api.url("/v1/batch/put"), data=body, headers=api.auth(token)) as r:
        assert r.status == 400, await r.text()
        doc = await r.json()
    assert doc["error"]["code"] in ("bad_framing", "invalid_key", "invalid_input") and doc["error"]["message"]
    assert doc["results"] == []
    await _intact(api, token)


async def test_framing_error_after_good_items_reports_them(api: Api, token: str) -> None:
    good = batchframe.encode_put_stream([("a", b"1" * 100), ("b", b"2" * 100)])
    body = good[: -len(batchframe.END)] + b"\xff\xff"  # then a key length of 65535
    async with api.session.post(api.url("/v1/batch/put"), data=body, headers=api.auth(token)) as r:
        doc = await r.json()
    assert r.status == 400 and [x["status"] for x in doc["results"]] == [201, 201]
    async with api.session.get(api.url("/v1/blocks/b"), headers=api.auth(token)) as r:
        assert await r.read() == b"2" * 100


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/v1/lookup", b"{not json", "invalid_input"),
        ("/v1/lookup", b"[1, 2]", "invalid_input"),
        ("/v1/lookup", b'{"keys": "k"}', "invalid_input"),
        ("/v1/lookup", b'{"keys": ["ok", "not ok"]}', "invalid_key"),
        ("/v1/batch/get", b'{"keys": [1]}', "invalid_key"),
    ],
)
async def test_invalid_json(api: Api, token: str, path: str, body: bytes, code: str) -> None:
    async with api.session.post(
        api.url(path), data=body, headers={**api.auth(token), "Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["code"] == code
    if code == "invalid_key" and path == "/v1/lookup":
        assert "keys[1]" in err["message"]
    await _intact(api, token)


async def test_too_many_keys(api: Api, token: str) -> None:
    keys = [f"k{i}" for i in range(api.config.max_lookup_keys + 1)]
    async with api.session.post(api.url("/v1/lookup"), json={"keys": keys}, headers=api.auth(token)) as r:
        assert r.status == 400 and "maximum" in (await r.json())["error"]["message"]
    keys = [f"k{i}" for i in range(api.config.max_batch_keys + 1)]
    async with api.session.post(api.url("/v1/batch/get"), json={"keys": keys}, headers=api.auth(token)) as r:
        assert r.status == 400
    await _intact(api, token)


async def test_huge_headers(api: Api, token: str) -> None:
    req = f"GET /v1/blocks/good HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 20000}\r\n\r\n".encode()
    resp = await _raw(api, req)
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"431" and b"application/json" in head
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    await _intact(api, token)
