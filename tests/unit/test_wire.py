"""The wire formats both sides speak (kvstore_client/wire), in one suite: the
key grammar, the batch framing and the frame codecs, each encoded and decoded
by the one definition (exact bytes, hypothesis round trips over real stream
readers, every error with its message), and each side's mapping of it: the
daemon's errors and codec ids, the client's errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import struct

import aiohttp
import pytest
from aiohttp.base_protocol import BaseProtocol
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_client import keys as client_keys
from kvstore_client.errors import InvalidKeyError
from kvstore_client.wire import codec
from kvstore_client.wire.batchframe import (
    CONTENT_TYPE,
    END,
    MAGIC,
    MAGIC_META,
    META_MAX,
    encode_get_stream,
    encode_put_stream,
    error_payload,
    get_item_header,
    put_item_header,
    put_stream_parts,
    read_get_items,
    read_put_items,
    read_put_items_meta,
)
from kvstore_client.wire.errors import BadFraming, CorruptFrame, InvalidKey, TooLarge
from kvstore_client.wire.keys import KEY_MAX_LEN, check_key, key_problem

from kvstore import errors as daemon_errors
from kvstore.config import COMPRESSIONS
from kvstore.engine import codec as engine_codec
from kvstore.engine.format import CODEC_NAMES, CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_BP2
from kvstore.names import validate_key
from kvstore.transport import batchframe as daemon_batchframe
from tests.conftest import kv_sample

KEY_CHARS = "abcXYZ019._~:@=+-"
MiB = 1 << 20


# -- helpers --------------------------------------------------------------------------


def fed(data: bytes) -> asyncio.StreamReader:
    """A StreamReader holding ``data`` and then the end of the stream."""
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


async def dribble(r: asyncio.StreamReader, data: bytes, chunk: int) -> None:
    """Feed ``data`` ``chunk`` bytes at a time, yielding to the reader between chunks."""
    for i in range(0, len(data), chunk):
        r.feed_data(data[i : i + chunk])
        await asyncio.sleep(0)
    r.feed_eof()


async def put_items(
    data: bytes, *, chunk: int | None = None, max_block_size: int = MiB, max_items: int = 1000
) -> list[tuple[str, bytes]]:
    if chunk is None:
        return [item async for item in read_put_items(fed(data), max_block_size, max_items)]
    r = asyncio.StreamReader()
    feeder = asyncio.create_task(dribble(r, data, chunk))
    try:
        return [item async for item in read_put_items(r, max_block_size, max_items)]
    finally:
        await feeder


async def get_items(
    data: bytes, *, chunk: int | None = None, max_payload: int | None = None
) -> list[tuple[str, int, bytes]]:
    if chunk is None:
        return [item async for item in read_get_items(fed(data), max_payload=max_payload)]
    r = asyncio.StreamReader()
    feeder = asyncio.create_task(dribble(r, data, chunk))
    try:
        return [item async for item in read_get_items(r, max_payload=max_payload)]
    finally:
        await feeder


async def put_until_error(data: bytes, **limits: int) -> tuple[list[tuple[str, bytes]], BadFraming | TooLarge]:
    """The items decoded before the error, and the error."""
    got: list[tuple[str, bytes]] = []
    with pytest.raises((BadFraming, TooLarge)) as info:
        async for item in read_put_items(fed(data), limits.get("max_block_size", MiB), limits.get("max_items", 100)):
            got.append(item)
    err = info.value
    assert isinstance(err, BadFraming | TooLarge)
    return got, err


def u16(n: int) -> bytes:
    return struct.pack("<H", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


# -- the key grammar ----------------------------------------------------------------------

KEY_RE = re.compile(r"[A-Za-z0-9._~:@=+\-]{1,256}")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=300), st.text(alphabet=KEY_CHARS + "/ ?\x00\u00e9", max_size=260)))
def test_both_sides_apply_one_key_grammar(key: str) -> None:
    valid = KEY_RE.fullmatch(key) is not None
    assert (key_problem(key) is None) == valid
    for check, error in ((check_key, InvalidKey), (validate_key, daemon_errors.InvalidKey)):
        if valid:
            assert check(key) == key
        else:
            with pytest.raises(error):
                check(key)
    if valid:
        assert client_keys.check_key(key) == key
    else:
        with pytest.raises(InvalidKeyError):
            client_keys.check_key(key)


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "key is empty; expected 1-256 characters of [A-Za-z0-9._~:@=+-]"),
        ("k" * 257, "key is 257 characters long; the maximum is 256"),
        ("a/b", "key contains '/' at position 1; allowed characters are [A-Za-z0-9._~:@=+-]"),
        (7, "key must be a string, got int"),
    ],
)
def test_a_bad_key_says_what_is_wrong_on_both_sides(key: object, problem: str) -> None:
    assert key_problem(key) == problem
    with pytest.raises(daemon_errors.InvalidKey) as daemon:
        validate_key(key)
    assert str(daemon.value) == problem and daemon.value.code == "invalid_key"
    with pytest.raises(InvalidKeyError, match=re.escape(problem)):
        client_keys.check_key(key)  # type: ignore[arg-type]
    assert KEY_MAX_LEN == 256


# -- batch framing: encoding ---------------------------------------------------------------------------


def test_constants() -> None:
    assert MAGIC == b"KVB1"
    assert END == b"\x00\x00"
    assert CONTENT_TYPE == "application/x-kvstore-batch"


def test_put_item_header_bytes() -> None:
    assert put_item_header("ab", 3) == b"\x02\x00ab\x03\x00\x00\x00\x00\x00\x00\x00"
    assert put_item_header("k", 0x0102030405060708) == b"\x01\x00k\x08\x07\x06\x05\x04\x03\x02\x01"
    long_key = "k" * 256
    assert put_item_header(long_key, 1) == b"\x00\x01" + long_key.encode() + u64(1)


def test_get_item_header_bytes() -> None:
    assert get_item_header("ab", 200, 3) == b"\x02\x00ab\xc8\x00\x03\x00\x00\x00\x00\x00\x00\x00"
    assert get_item_header("ab", 404, 0) == b"\x02\x00ab\x94\x01" + bytes(8)


def test_encode_put_stream_bytes() -> None:
    # The example of docs/batch-framing.md.
    stream = encode_put_stream([("a1", b"hi"), ("b", b"\x00\xff\x10")])
    assert stream.hex(" ") == (
        "4b 56 42 31 02 00 61 31 02 00 00 00 00 00 00 00 68 69 01 00 62 03 00 00 00 00 00 00 00 00 ff 10 00 00"
    )
    assert encode_put_stream([]) == MAGIC + END


def test_encode_put_stream_takes_any_buffer() -> None:
    data = bytearray(b"xyz")
    assert encode_put_stream([("k", data)]) == encode_put_stream([("k", b"xyz")])
    assert encode_put_stream([("k", memoryview(b"xyz"))]) == encode_put_stream([("k", b"xyz")])


def test_encode_get_stream_bytes() -> None:
    err = error_payload("not_found", "no block b")
    stream = encode_get_stream([("a1", 200, b"hi"), ("b", 404, err)])
    assert stream == (
        MAGIC + b"\x02\x00a1" + u16(200) + u64(2) + b"hi" + b"\x01\x00b" + u16(404) + u64(len(err)) + err + END
    )


@pytest.mark.parametrize("key", ["", "a/b", "k" * 257, "caf\u00e9", "a b"])
def test_encoders_reject_invalid_keys(key: str) -> None:
    with pytest.raises(InvalidKey):
        put_item_header(key, 1)
    with pytest.raises(InvalidKey):
        get_item_header(key, 200, 1)
    with pytest.raises(InvalidKey):
        encode_put_stream([(key, b"x")])


@pytest.mark.parametrize("data_len", [0, -1, 1 << 64])
def test_put_item_header_rejects_bad_lengths(data_len: int) -> None:
    with pytest.raises(ValueError, match="data_len"):
        put_item_header("k", data_len)


def test_encode_put_stream_rejects_empty_data() -> None:
    with pytest.raises(ValueError, match="data_len"):
        encode_put_stream([("k", b"")])


@pytest.mark.parametrize(("status", "payload_len"), [(99, 1), (600, 1), (0, 1), (200, -1), (200, 1 << 64)])
def test_get_item_header_rejects_bad_values(status: int, payload_len: int) -> None:
    with pytest.raises(ValueError, match=r"status|payload_len"):
        get_item_header("k", status, payload_len)


def test_error_payload_is_utf8_json() -> None:
    payload = error_payload("not_found", "no block named k\u00e9y")
    assert json.loads(payload.decode("utf-8")) == {"code": "not_found", "message": "no block named k\u00e9y"}
    assert "\u00e9".encode() in payload


# -- batch framing: read_put_items, round trips -----------------------------------------------------------


async def test_put_empty_batch() -> None:
    assert await put_items(MAGIC + END) == []


async def test_put_round_trip_many_items() -> None:
    items = [(f"blk-{i:04d}:{'x' * (i % 7)}", bytes([i % 251]) * (1 + (i * 37) % 3000)) for i in range(400)]
    assert await put_items(encode_put_stream(items)) == items


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
async def test_put_round_trip_in_tiny_chunks(chunk: int) -> None:
    items = [("a", b"x"), ("k" * 256, bytes(range(256)) * 3), ("=+~:@.-_", b"\x00" * 17)]
    assert await put_items(encode_put_stream(items), chunk=chunk) == items


async def test_put_limits_are_inclusive() -> None:
    items = [("a", b"1234"), ("b", b"5678")]
    assert await put_items(encode_put_stream(items), max_block_size=4, max_items=2) == items


async def test_put_yields_each_item_before_the_rest_arrives() -> None:
    r = asyncio.StreamReader()
    first = encode_put_stream([("first", b"one")])[: -len(END)]
    r.feed_data(first)
    gen = read_put_items(r, MiB, 10)
    assert await asyncio.wait_for(anext(gen), 5) == ("first", b"one")
    # The second item is only half there: the decoder waits for it.
    second = put_item_header("second", 3) + b"two"
    r.feed_data(second[:5])
    pending = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0.01)
    assert not pending.done()
    r.feed_data(second[5:] + END)
    r.feed_eof()
    assert await asyncio.wait_for(pending, 5) == ("second", b"two")
    with pytest.raises(StopAsyncIteration):
        await anext(gen)


async def test_put_with_aiohttp_stream_reader() -> None:
    loop = asyncio.get_running_loop()
    r = aiohttp.StreamReader(BaseProtocol(loop), 2**16, loop=loop)
    items = [("k1", b"a" * 100_000), ("k2", b"b")]
    data = encode_put_stream(items)
    for i in range(0, len(data), 4096):
        r.feed_data(data[i : i + 4096])
    r.feed_eof()
    assert [item async for item in read_put_items(r, MiB, 10)] == items


async def test_put_empty_aiohttp_body_is_truncated() -> None:
    with pytest.raises(BadFraming, match=r"truncated stream: the 4-byte magic at byte offset 0: expected 4 bytes"):
        _ = [item async for item in read_put_items(aiohttp.streams.EMPTY_PAYLOAD, MiB, 10)]


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.text(alphabet=KEY_CHARS, min_size=1, max_size=256), st.binary(min_size=1, max_size=300)),
        max_size=12,
    ),
    chunk=st.sampled_from([None, 1, 5, 4096]),
)
def test_put_round_trip_property(items: list[tuple[str, bytes]], chunk: int | None) -> None:
    stream = encode_put_stream(items)
    assert len(stream) == 6 + sum(2 + len(k) + 8 + len(d) for k, d in items)
    assert asyncio.run(put_items(stream, chunk=chunk)) == items


# -- batch framing: read_put_items, errors ----------------------------------------------------------------

TWO = encode_put_stream([("ab", b"xyz"), ("c", b"\x01")])
# offsets in TWO: magic 0, item 0: key_len 4, key 6, data_len 8, data 16;
#                 item 1: key_len 19, key 21, data_len 22, data 30; end marker 31


async def test_put_empty_stream() -> None:
    got, err = await put_until_error(b"")
    assert got == []
    assert isinstance(err, BadFraming)
    assert str(err) == "truncated stream: the 4-byte magic at byte offset 0: expected 4 bytes, the stream ended after 0"


@pytest.mark.parametrize("magic", [b"KVB3", b"kvb1", b"\x00\x00\x00\x00", b"POST"])
async def test_put_bad_magic(magic: bytes) -> None:
    got, err = await put_until_error(magic + TWO[4:])
    assert got == []
    assert isinstance(err, BadFraming)
    expected = "expected b'KVB1' or b'KVB2' (application/x-kvstore-batch)"
    assert str(err) == f"bad magic {magic!r} at byte offset 0: {expected}"


@pytest.mark.parametrize("key_len", [257, 300, 65535])
async def test_put_key_too_long(key_len: int) -> None:
    got, err = await put_until_error(TWO[:19] + u16(key_len) + b"k" * key_len + u64(1) + b"x" + END)
    assert got == [("ab", b"xyz")]
    assert isinstance(err, BadFraming)
    assert str(err) == f"item 1: key length {key_len} at byte offset 19: expected 1 to 256"


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (b"a/b", "key contains '/' at position 1"),
        (b"a b", "key contains ' ' at position 1"),
        (b"ok\xff", "byte 0xff at position 2 is not ASCII"),
        (b"caf\xc3\xa9", "byte 0xc3 at position 3 is not ASCII"),
        (b"\x00", "key contains '\\x00' at position 0"),
    ],
)
async def test_put_invalid_key(key: bytes, why: str) -> None:
    got, err = await put_until_error(TWO[:19] + u16(len(key)) + key + u64(1) + b"x" + END)
    assert got == [("ab", b"xyz")]
    assert isinstance(err, BadFraming)
    assert str(err).startswith("item 1: invalid key at byte offset 21: " + why)
    assert "allowed characters are [A-Za-z0-9._~:@=+-]" in str(err)


async def test_put_zero_data_length() -> None:
    got, err = await put_until_error(MAGIC + u16(2) + b"ab" + u64(0) + END)
    assert got == []
    assert isinstance(err, BadFraming)
    assert str(err) == "item 0 (ab): data length 0 at byte offset 8: blocks are 1 byte or more"


@pytest.mark.parametrize("data_len", [5, 1 << 32, (1 << 64) - 1])
async def test_put_block_too_large_before_reading_the_data(data_len: int) -> None:
    # Only the header is there: a decoder that read the data first would report a truncation.
    got, err = await put_until_error(TWO[:19] + u16(1) + b"c" + u64(data_len), max_block_size=4)
    assert got == [("ab", b"xyz")]
    assert isinstance(err, TooLarge)
    assert str(err) == f"item 1 (c): data length {data_len} at byte offset 22 exceeds the maximum block size 4"


async def test_put_too_many_items() -> None:
    got, err = await put_until_error(TWO, max_items=1)
    assert got == [("ab", b"xyz")]
    assert isinstance(err, BadFraming)
    assert str(err) == "item 1 at byte offset 19: a batch holds at most 1 items"


async def test_put_too_many_items_is_found_before_the_key_is_read() -> None:
    # The extra item's key length is there, nothing more.
    got, err = await put_until_error(TWO[:21], max_items=1)
    assert got == [("ab", b"xyz")]
    assert "at most 1 items" in str(err)


async def test_put_missing_end_marker() -> None:
    got, err = await put_until_error(TWO[: -len(END)])
    assert got == [("ab", b"xyz"), ("c", b"\x01")]
    assert str(err) == (
        "truncated stream: item 2: key length (or the end marker 00 00) at byte offset 31: "
        "expected 2 bytes, the stream ended after 0"
    )


async def test_put_half_end_marker() -> None:
    got, err = await put_until_error(TWO[:-1])
    assert len(got) == 2
    assert str(err).startswith("truncated stream: item 2: key length (or the end marker 00 00) at byte offset 31")
    assert str(err).endswith("the stream ended after 1")


async def test_put_data_after_end_marker() -> None:
    got, err = await put_until_error(TWO + b"\x01\x00k")
    assert len(got) == 2
    assert isinstance(err, BadFraming)
    assert str(err) == "unexpected data b'\\x01'... at byte offset 33, after the end marker that follows 2 items"


async def test_put_truncated_anywhere() -> None:
    # Every proper prefix of a stream fails as truncated, after yielding exactly the complete items.
    what = {range(0, 4): "the 4-byte magic", range(4, 6): "item 0: key length", range(6, 8): "item 0: 2-byte key"}
    what |= {range(8, 16): "item 0 (ab): 8-byte data length", range(16, 19): "item 0 (ab): 3-byte data"}
    what |= {range(19, 21): "item 1: key length", range(21, 22): "item 1: 1-byte key"}
    what |= {range(22, 30): "item 1 (c): 8-byte data length", range(30, 31): "item 1 (c): 1-byte data"}
    what |= {range(31, 33): "item 2: key length"}
    for cut in range(len(TWO)):
        got, err = await put_until_error(TWO[:cut])
        assert len(got) == (0 if cut < 19 else 1 if cut < 31 else 2), cut
        assert isinstance(err, BadFraming)
        expected = next(v for k, v in what.items() if cut in k)
        assert str(err).startswith(f"truncated stream: {expected}"), (cut, str(err))


async def test_put_error_in_tiny_chunks_too() -> None:
    r = asyncio.StreamReader()
    feeder = asyncio.create_task(dribble(r, TWO[:25], 1))
    got: list[tuple[str, bytes]] = []
    with pytest.raises(BadFraming, match=r"item 1 \(c\): 8-byte data length at byte offset 22: expected 8 bytes"):
        async for item in read_put_items(r, MiB, 10):
            got.append(item)
    await feeder
    assert got == [("ab", b"xyz")]


@pytest.mark.parametrize(("max_block_size", "max_items"), [(0, 1), (1, 0), (-1, 5)])
async def test_put_limits_must_be_positive(max_block_size: int, max_items: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        await anext(read_put_items(fed(TWO), max_block_size, max_items))


# -- batch framing: read_get_items ------------------------------------------------------------------------


async def test_get_round_trip() -> None:
    missing = error_payload("not_found", "no block named b")
    broken = error_payload("corruption", "stored bytes failed an integrity check")
    items = [("a", 200, b"\x00" * 1000), ("b", 404, missing), ("c", 500, broken), ("d", 200, b"z")]
    got = await get_items(encode_get_stream(items))
    assert got == items
    assert json.loads(got[1][2]) == {"code": "not_found", "message": "no block named b"}


async def test_get_empty_batch_and_empty_error_payload() -> None:
    assert await get_items(MAGIC + END) == []
    assert await get_items(encode_get_stream([("k", 404, b"")])) == [("k", 404, b"")]


@pytest.mark.parametrize("chunk", [1, 3, 11])
async def test_get_round_trip_in_tiny_chunks(chunk: int) -> None:
    items = [("k" * 256, 200, bytes(range(256))), ("x", 503, error_payload("not_ready", "closing"))]
    assert await get_items(encode_get_stream(items), chunk=chunk) == items


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(
        st.tuples(
            st.text(alphabet=KEY_CHARS, min_size=1, max_size=40),
            st.sampled_from([200, 404, 500, 503]),
            st.binary(min_size=1, max_size=200),
        ),
        max_size=10,
    ),
    chunk=st.sampled_from([None, 1, 6]),
)
def test_get_round_trip_property(items: list[tuple[str, int, bytes]], chunk: int | None) -> None:
    assert asyncio.run(get_items(encode_get_stream(items), chunk=chunk)) == items


async def get_error(data: bytes, max_payload: int | None = None) -> tuple[list[tuple[str, int, bytes]], BadFraming]:
    got: list[tuple[str, int, bytes]] = []
    with pytest.raises(BadFraming) as info:
        async for item in read_get_items(fed(data), max_payload=max_payload):
            got.append(item)
    return got, info.value


GET_ONE = encode_get_stream([("ab", 200, b"xyz")])
# offsets: magic 0, key_len 4, key 6, status 8, payload_len 10, payload 18, end marker 21


@pytest.mark.parametrize("status", [0, 99, 600, 65535])
async def test_get_bad_status(status: int) -> None:
    got, err = await get_error(MAGIC + u16(1) + b"k" + u16(status) + u64(1) + b"x" + END)
    assert got == []
    assert str(err) == f"item 0 (k): status {status} at byte offset 7: expected 100 to 599"


async def test_get_200_needs_a_payload() -> None:
    got, err = await get_error(MAGIC + u16(1) + b"k" + u16(200) + u64(0) + END)
    assert got == []
    assert str(err) == "item 0 (k): status 200 with an empty payload at byte offset 7"


async def test_get_max_payload() -> None:
    assert await get_items(GET_ONE, max_payload=3) == [("ab", 200, b"xyz")]
    got, err = await get_error(GET_ONE, max_payload=2)
    assert got == []
    assert str(err) == "item 0 (ab): payload length 3 at byte offset 10 exceeds the limit 2"


async def test_get_bad_magic_and_keys() -> None:
    _, err = await get_error(b"KVB0" + GET_ONE[4:])
    assert str(err).startswith("bad magic b'KVB0' at byte offset 0")
    _, err = await get_error(MAGIC + u16(300) + b"k" * 300)
    assert str(err) == "item 0: key length 300 at byte offset 4: expected 1 to 256"
    _, err = await get_error(MAGIC + u16(2) + b"a?" + u16(200) + u64(1) + b"x" + END)
    assert str(err).startswith("item 0: invalid key at byte offset 6: key contains '?' at position 1")


async def test_get_truncated_anywhere_and_trailing_data() -> None:
    for cut in range(len(GET_ONE)):
        got, err = await get_error(GET_ONE[:cut])
        assert got == ([("ab", 200, b"xyz")] if cut >= 21 else []), cut
        assert str(err).startswith("truncated stream: "), (cut, str(err))
    _, err = await get_error(GET_ONE[:12])
    assert str(err) == (
        "truncated stream: item 0 (ab): 2-byte status and 8-byte payload length at byte offset 8: "
        "expected 10 bytes, the stream ended after 4"
    )
    got, err = await get_error(GET_ONE + b"\x00")
    assert got == [("ab", 200, b"xyz")]
    assert str(err) == "unexpected data b'\\x00'... at byte offset 23, after the end marker that follows 1 items"


async def test_get_items_streams() -> None:
    r = asyncio.StreamReader()
    gen = read_get_items(r)
    r.feed_data(GET_ONE[: -len(END)])
    assert await asyncio.wait_for(anext(gen), 5) == ("ab", 200, b"xyz")
    r.feed_data(END)
    r.feed_eof()
    with pytest.raises(StopAsyncIteration):
        await anext(gen)


async def test_kvb2_put_items_carry_their_identities() -> None:
    metas = [b'{"block_hash": 7}', None, b'{"block_hash": 9, "token_ids": [1, 2]}']
    body = encode_put_stream([("a", b"1" * 10), ("b", b"2" * 20), ("c", b"3" * 30)], metas)
    assert body.startswith(MAGIC_META)
    # a: u16 1, "a", u32 17, the JSON, u64 10
    assert body[4:28] == b"\x01\x00a\x11\x00\x00\x00" + metas[0]  # type: ignore[operator]
    for chunk in (None, 1, 7):
        r = asyncio.StreamReader()
        if chunk is None:
            got = [i async for i in read_put_items_meta(fed(body), MiB, 10)]
        else:
            feeder = asyncio.create_task(dribble(r, body, chunk))
            got = [i async for i in read_put_items_meta(r, MiB, 10)]
            await feeder
        assert got == [("a", b"1" * 10, metas[0]), ("b", b"2" * 20, None), ("c", b"3" * 30, metas[2])]
    # The plain reader takes KVB2 too (the identities dropped), and KVB1 gives no identities.
    assert await put_items(body) == [("a", b"1" * 10), ("b", b"2" * 20), ("c", b"3" * 30)]
    plain = encode_put_stream([("a", b"1")])
    assert [i async for i in read_put_items_meta(fed(plain), MiB, 10)] == [("a", b"1", None)]
    # A meta length over the limit is bad framing, naming the item and the offset.
    huge = MAGIC_META + b"\x01\x00a" + (META_MAX + 1).to_bytes(4, "little")
    with pytest.raises(BadFraming, match=r"item 0 \(a\): meta length .* at byte offset 7"):
        [i async for i in read_put_items_meta(fed(huge), MiB, 10)]
    with pytest.raises(BadFraming, match="truncated stream: item 0 \\(a\\): 17-byte meta"):
        [i async for i in read_put_items_meta(fed(body[:15]), MiB, 10)]


# -- batch framing: the spec's examples, the client's parts, the daemon's errors ---------------


def test_framing_matches_the_spec_example() -> None:
    """docs/batch-framing.md's examples, byte for byte."""
    assert encode_put_stream([("a1", b"hi"), ("b", b"\x00\xff\x10")]).hex() == (
        "4b56423102006131020000000000000068690100620300000000000000" + "00ff100000"
    )
    stream = bytes.fromhex(
        "4b56423102006131c8000200000000000000686902007a7a94012f0000000000000"
        "07b22636f6465223a20226e6f745f666f756e64222c20226d657373616765223a20226e6f20626c6f636b207a7a227d0000"
    )
    items = [("a1", 200, b"hi"), ("zz", 404, b'{"code": "not_found", "message": "no block zz"}')]
    assert stream == encode_get_stream(items)
    assert asyncio.run(get_items(stream)) == items


def test_put_stream_parts_hold_the_blocks_themselves() -> None:
    """The client sends the parts as they are: the blocks are not copied."""
    block = bytearray(b"x" * 1000)
    parts = put_stream_parts([("k", block)], [b'{"block_hash": 1}'])
    assert any(p is block for p in parts)
    assert b"".join(parts) == encode_put_stream([("k", bytes(block))], [b'{"block_hash": 1}'])


async def test_the_daemon_answers_bad_framing_400_and_a_large_block_413() -> None:
    """kvstore/transport/batchframe.py: the wire's put decoder with the daemon's errors."""
    with pytest.raises(daemon_errors.BadFraming) as bad:
        _ = [i async for i in daemon_batchframe.read_put_items_meta(fed(b"KVB3" + TWO[4:]), MiB, 10)]
    assert (bad.value.code, bad.value.retryable) == ("bad_framing", False)  # a 400
    assert str(bad.value).startswith("bad magic b'KVB3' at byte offset 0")
    got = []
    with pytest.raises(daemon_errors.BlockTooLarge) as large:
        async for item in daemon_batchframe.read_put_items_meta(fed(TWO), 2, 10):
            got.append(item)
    assert large.value.code == "block_too_large"  # a 413
    assert str(large.value) == "item 0 (ab): data length 3 at byte offset 8 exceeds the maximum block size 2"
    assert got == []
    assert [i async for i in daemon_batchframe.read_put_items_meta(fed(TWO), MiB, 10)] == [
        ("ab", b"xyz", None),
        ("c", b"\x01", None),
    ]


# -- frame codecs: the daemon encodes, either side decodes -----------------------------------


def _round_trip(data: bytes, compression: str) -> tuple[int, int]:
    """Encoded as the engine stores a frame (its codec id), decoded by the
    wire (the codec's name, as the client sees it) and by the engine."""
    codec_id, stored = engine_codec.encode_frame(memoryview(data), compression, 1)  # type: ignore[arg-type]
    out = bytearray(len(data))
    codec.decode_frame(CODEC_NAMES[codec_id], memoryview(stored), memoryview(out))
    assert out == data
    again = bytearray(len(data))
    engine_codec.decode_frame(codec_id, memoryview(stored), memoryview(again))
    assert again == data
    return codec_id, len(stored)


@given(st.binary(min_size=1, max_size=5000), st.sampled_from(COMPRESSIONS))
def test_frame_round_trip_any_bytes(data: bytes, compression: str) -> None:
    _, stored_len = _round_trip(data, compression)
    assert stored_len <= len(data)  # never grows: raw fallback


@pytest.mark.parametrize("n", [1, 63, 64, 65, 4095, 4096, 4097, 1 << 20])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_frame_round_trip_sizes(n: int, compression: str) -> None:
    kv = kv_sample("gemma3-270m.bf16.layers8-9.bin")
    _round_trip(kv[:n], compression)
    _round_trip(bytes(n), compression)


def test_incompressible_is_stored_raw() -> None:
    codec_id, stored_len = _round_trip(os.urandom(1 << 16), "zstd-bp2")
    assert codec_id == CODEC_RAW and stored_len == 1 << 16


def _ratio(data: bytes, compression: str, frame: int = 1 << 20) -> float:
    stored = 0
    for i in range(0, len(data), frame):
        stored += _round_trip(data[i : i + frame], compression)[1]
    return len(data) / stored


def test_byte_plane_split_pays_on_real_kv() -> None:
    """Measured on real KV caches (see bench/data/kv/README.md)."""
    bf16 = kv_sample("minilm-l6-v2.bf16.first2MiB.bin")
    f16 = kv_sample("minilm-l6-v2.f16.first2MiB.bin")
    assert _ratio(bf16, "zstd-bp2") > 1.45 > _ratio(bf16, "zstd")
    assert _ratio(f16, "zstd-bp2") > 1.15 > _ratio(f16, "zstd")
    assert engine_codec.encode_frame(memoryview(bf16[: 1 << 20]), "zstd-bp2", 1)[0] == CODEC_ZSTD_BP2
    assert engine_codec.encode_frame(memoryview(bf16[: 1 << 20]), "zstd", 1)[0] == CODEC_ZSTD
    assert codec.encode_frame(memoryview(bf16[: 1 << 20]), "zstd-bp2", 1)[0] == "zstd-bp2"


@pytest.mark.parametrize(
    ("sample", "few"),
    [
        ("gemma3-270m.bf16.layers8-9.bin", True),
        ("minilm-l6-v2.bf16.first2MiB.bin", True),
        ("gemma3-270m.f16.layer8.bin", False),
        ("minilm-l6-v2.f16.first2MiB.bin", False),
    ],
)
def test_the_high_plane_probe_picks_its_compressor(sample: str, few: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16's exponent plane (few distinct values) gets the narrow-window
    parameters, fp16's does not; both decode, and the narrow window compresses
    a bf16 plane at least as well as level 1 does."""
    import numpy as np

    data = kv_sample(sample)[: 1 << 20]
    high = np.frombuffer(data, dtype=np.uint8)[1::2]
    chosen = codec._plane_compressor(high, 1)
    assert (chosen is not codec._compressor(1)) == few
    assert codec._plane_compressor(high, 3) is codec._compressor(3)  # other levels: zstd's own
    assert _round_trip(data, "zstd-bp2")[0] == CODEC_ZSTD_BP2
    if few:
        plane = high.tobytes()
        assert len(chosen.compress(plane)) <= len(codec._compressor(1).compress(plane))


def _bp2(data: bytes) -> bytes:
    name, stored = codec.encode_frame(memoryview(data), "zstd-bp2", 1)
    assert name == "zstd-bp2"
    return bytes(stored)


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        ("raw", lambda s: s[:-1], "raw frame is"),
        ("zstd", lambda s: s[:-5], "frame does not decode"),
        ("zstd-bp2", lambda s: s[:6], "frame does not decode"),  # a header cut short
        ("zstd-bp2", lambda s: s + b"x", "byte-plane frame lengths are inconsistent"),
        ("lz4", lambda s: s, "unknown frame codec 'lz4'"),
    ],
)
def test_a_frame_that_does_not_decode_is_corrupt_on_both_sides(name: str, damage: object, message: str) -> None:
    data = kv_sample("minilm-l6-v2.bf16.first2MiB.bin")[: 1 << 16]
    stored = {"raw": data, "zstd": bytes(codec.encode_frame(memoryview(data), "zstd", 1)[1])}.get(name) or _bp2(data)
    bad = damage(stored)  # type: ignore[operator]
    with pytest.raises(CorruptFrame, match=re.escape(message)):
        codec.decode_frame(name, memoryview(bad), memoryview(bytearray(len(data))))
    codec_id = {v: k for k, v in CODEC_NAMES.items()}.get(name, 99)
    with pytest.raises(daemon_errors.CorruptionError) as e:
        engine_codec.decode_frame(codec_id, memoryview(bad), memoryview(bytearray(len(data))))
    assert e.value.code == "corruption"


def test_all_keys_valid_agrees_with_key_problem_key_by_key() -> None:
    """The one-pass check of a lookup's keys says exactly what checking
    each key with key_problem says, on valid, empty, too long, non-string
    and wrong-character keys, alone and among valid ones."""
    import random

    from kvstore_client.wire.keys import KEY_MAX_LEN, all_keys_valid, key_problem

    rng = random.Random(5)
    alphabet = "ABCxyz019._~:@=+-"
    odd: list[object] = ["", "a" * (KEY_MAX_LEN + 1), "a b", "é", "a/b", "a\n", 7, None, b"bytes", "a" * KEY_MAX_LEN]
    for _ in range(400):
        keys: list[object] = ["".join(rng.choices(alphabet, k=rng.randint(1, 40))) for _ in range(rng.randint(0, 6))]
        if rng.random() < 0.5:
            keys.insert(rng.randint(0, len(keys)), rng.choice(odd))
        assert all_keys_valid(keys) == all(key_problem(k) is None for k in keys), keys
