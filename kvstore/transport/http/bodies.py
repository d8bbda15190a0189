"""Request bodies: every read bounded in time and in memory.

- **Time.** A whole body (a block, a JSON document) must arrive within
  ``request_timeout_s``; a batch stream, which may take as long as it needs,
  must not stall for longer than that between reads. Either way a stalled
  client gets ``408 request_timeout`` and its slot is freed.
- **Memory.** Bodies held in memory (a block until it is stored, a JSON
  document until it is parsed, the blocks of a batch in flight) share one
  budget, ``max_buffered_body_bytes``. A body that would push past it is
  refused with ``503 overloaded`` (``Retry-After``) before it is read, instead
  of memory growing with ``max_concurrency`` times ``max_block_size``.
- **JSON.** UTF-8 (RFC 8259 §8.1), at most :data:`JSON_MAX_BYTES`, arrays and
  objects nested at most :data:`kvstore.jsonlimits.MAX_DEPTH` deep; each way
  a document can be wrong is a 4xx naming it, never a 500.
- **Fields** several routes read (``lease_s``, ``keys``) are checked here, once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import StreamReader, web

from kvstore import jsonlimits
from kvstore.buffers import POOL, AlignedBuffer
from kvstore.errors import (
    BlockTooLarge,
    BodyTooLarge,
    InvalidInput,
    LengthRequired,
    RequestTimeout,
    UnsupportedMediaType,
)
from kvstore.names import validate_key
from kvstore.transport.http.appkeys import config_of
from kvstore.transport.http.qos import ticket_of

JSON_MAX_BYTES = 4 << 20
# The answer to a body aiohttp's parser could not decode (its message quotes the bytes).
BAD_BODY_FRAMING = "malformed request body: bad chunked framing or content coding"
_JSON_CHARSETS = frozenset({"utf-8", "utf8", "us-ascii", "ascii"})


def check_length(request: web.Request, limit: int) -> int:
    """The request's Content-Length, if it is acceptable for a block."""
    length = request.content_length
    if length is None:
        raise LengthRequired("Content-Length is required (chunked uploads are not accepted)")
    if length > limit:
        raise BlockTooLarge(f"body is {length} bytes; the maximum block size is {limit}")
    if length == 0:
        raise InvalidInput("body is empty; blocks are 1 byte or more")
    return length


async def _read_exactly(request: web.Request, length: int) -> bytes:
    """``length`` bytes of body within the request timeout."""
    seconds = config_of(request).request_timeout_s
    try:
        async with asyncio.timeout(seconds):
            return await request.content.readexactly(length)
    except TimeoutError:
        raise RequestTimeout(f"body not received within {seconds} s") from None
    except asyncio.IncompleteReadError as e:
        raise InvalidInput(f"body ended after {len(e.partial)} of {length} bytes (Content-Length)") from None


async def _receive_into(content: StreamReader, length: int) -> AlignedBuffer:
    """``length`` bytes of ``content`` received into pooled page-aligned
    memory chunk by chunk (no join; the segment write takes it from there
    without another copy: engine/directio.py). An early end raises
    ``asyncio.IncompleteReadError``; the buffer goes back to the pool on any
    failure."""
    buf = POOL.take(length)
    mem, pos = buf.memory, 0
    try:
        while pos < length:
            chunk = await content.read(length - pos)  # at most that: what follows stays buffered
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(mem[:pos]), length)
            mem[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
    except BaseException:
        buf.release()
        raise
    return buf


async def _read_aligned(request: web.Request, length: int) -> AlignedBuffer:
    """A block's ``length`` bytes of body within the request timeout, in aligned memory."""
    seconds = config_of(request).request_timeout_s
    try:
        async with asyncio.timeout(seconds):
            return await _receive_into(request.content, length)
    except TimeoutError:
        raise RequestTimeout(f"body not received within {seconds} s") from None
    except asyncio.IncompleteReadError as e:
        raise InvalidInput(f"body ended after {len(e.partial)} of {length} bytes (Content-Length)") from None


@asynccontextmanager
async def block_body(request: web.Request, limit: int) -> AsyncIterator[memoryview]:
    """A block's body (exactly Content-Length bytes, 1 to ``limit``), held
    against the budget until the ``async with`` block ends. Its memory goes
    back to the pool only when the block ends without an exception: a put
    that was cancelled may still have its bytes queued for a write."""
    length = check_length(request, limit)
    ticket = ticket_of(request)
    await ticket.reserve("write", length)  # its write limit, before the body is read
    ticket.hold_body(length)
    try:
        buf = await _read_aligned(request, length)
        ticket.moved("in", length)
        async with ticket.transfer():  # (for its store: the body is in)
            yield buf.view
        buf.release()
    finally:
        ticket.release_body(length)


def _check_charset(request: web.Request) -> None:
    charset = request.charset
    if charset is not None and charset.lower() not in _JSON_CHARSETS:
        raise UnsupportedMediaType(f"charset {charset[:40]!r} is not supported: JSON bodies are UTF-8 (RFC 8259)")


async def _read_chunked(request: web.Request, limit: int) -> bytes:
    """A body without Content-Length (chunked), up to ``limit`` bytes."""
    parts: list[bytes] = []
    size = 0
    seconds = config_of(request).request_timeout_s
    try:
        async with asyncio.timeout(seconds):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"JSON body is over {limit} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"body not received within {seconds} s") from None
    return b"".join(parts)


def _no_constant(name: str) -> Any:
    raise InvalidInput(f"request body is not valid JSON: {name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``, or a 400 naming what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"request body is not UTF-8 (byte {e.start}); JSON bodies are UTF-8") from None
    parse: Callable[[str], Any] = _DECODER.decode
    too_deep = f"request body is not acceptable JSON: arrays or objects nested more than {jsonlimits.MAX_DEPTH} deep"
    try:
        body = parse(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise InvalidInput(too_deep) from None
    except ValueError:
        # int(): over sys.get_int_max_str_digits() (4300) digits (CVE-2020-10735).
        raise InvalidInput("request body is not acceptable JSON: a number has too many digits") from None
    # A body with fewer brackets than the limit cannot nest deeper (the walk
    # costs a lookup of 128 keys a third of its parse).
    shallow = raw.count(b"[") + raw.count(b"{") <= jsonlimits.MAX_DEPTH
    if not shallow and jsonlimits.deeper_than(body, jsonlimits.MAX_DEPTH):
        raise InvalidInput(too_deep)
    if not isinstance(body, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body: UTF-8, at most JSON_MAX_BYTES, received
    within the request timeout and held against the budget while it is read."""
    _check_charset(request)
    length = request.content_length
    if length is not None and length > JSON_MAX_BYTES:
        raise BodyTooLarge(f"JSON body is {length} bytes; the maximum is {JSON_MAX_BYTES}")
    held = JSON_MAX_BYTES if length is None else length
    ticket = ticket_of(request)
    ticket.hold_body(held)
    try:
        raw = await (_read_chunked(request, JSON_MAX_BYTES) if length is None else _read_exactly(request, length))
        return parse_json(raw)
    finally:
        ticket.release_body(held)


ALIGNED_MIN = 64 << 10  # a batch item this big is received into aligned memory


@dataclass(slots=True)
class Held:
    """What a batch body handed over since the last take: bytes held against
    the budget, and the aligned buffers some of them are in."""

    nbytes: int = 0
    buffers: list[AlignedBuffer] = field(default_factory=list)


class BatchBody:
    """A batch stream's body for the framing decoder: every read must complete
    within ``seconds`` (a batch may take as long as it needs, a stalled client
    is cut off), and every byte read is held against the budget until the
    caller :meth:`take`\\ s it (and releases it once the block is stored).
    A block of :data:`ALIGNED_MIN` bytes or more is received into pooled
    aligned memory (:meth:`readblock`), written to its segment from there."""

    def __init__(self, request: web.Request) -> None:
        self._content = request.content
        self._seconds = config_of(request).request_timeout_s
        self._ticket = ticket_of(request)
        self._unowned = Held()

    async def readexactly(self, n: int, /) -> bytes:
        self._ticket.hold_body(n)
        try:
            async with asyncio.timeout(self._seconds):
                data = await self._content.readexactly(n)
        except BaseException:
            self._ticket.release_body(n)
            raise
        self._unowned.nbytes += n
        return data

    async def readblock(self, n: int, /) -> bytes | memoryview:
        if n < ALIGNED_MIN:
            return await self.readexactly(n)
        self._ticket.hold_body(n)
        try:
            async with asyncio.timeout(self._seconds):
                buf = await _receive_into(self._content, n)
        except BaseException:
            self._ticket.release_body(n)
            raise
        self._unowned.nbytes += n
        self._unowned.buffers.append(buf)
        return buf.view

    def take(self) -> Held:
        """What was read since the last take, now the caller's to release."""
        held, self._unowned = self._unowned, Held()
        return held

    def release(self, held: Held, reuse: bool = True) -> None:
        """Give ``held`` back: its bytes to the budget, its buffers to the pool
        (``reuse`` False: a put that was cancelled may still have its bytes
        queued for a write, so its memory is left to the collector)."""
        self._ticket.release_body(held.nbytes)
        if reuse:
            for buf in held.buffers:
                buf.release()

    def close(self) -> None:
        """Release what was read and never taken."""
        self.release(self.take())


# Fields of JSON bodies that several routes read.

LEASE_S = 30.0  # default lease of a read plan
MAX_LEASE_S = 600.0


def lease_field(body: dict[str, Any], default: float = LEASE_S) -> float:
    """A request's ``lease_s``: seconds in (0, MAX_LEASE_S]."""
    value = body.get("lease_s", default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LEASE_S:
        raise InvalidInput(f"field 'lease_s' must be a number of seconds in (0, {MAX_LEASE_S:g}]; got {value!r}")
    return float(value)


def tokens_per_block_field(body: dict[str, Any]) -> int:
    """A lookup's ``tokens_per_block``: 1 to 2**20, or 0 when absent."""
    tpb = body.get("tokens_per_block", 0)
    if (
        isinstance(tpb, bool)
        or not isinstance(tpb, int)
        or not ((tpb == 0 and "tokens_per_block" not in body) or 1 <= tpb <= 1 << 20)
    ):
        raise InvalidInput(f"field 'tokens_per_block' must be an integer from 1 to {1 << 20}; got {tpb!r}")
    return tpb


def keys_field(body: dict[str, Any], limit: int, validate: bool = True) -> list[str]:
    """The request's ``keys``: a list of at most ``limit`` keys, each checked
    unless ``validate`` is False (the store checks them itself)."""
    keys = body.get("keys")
    if not isinstance(keys, list):
        raise InvalidInput("field 'keys' must be a list of keys")
    if len(keys) > limit:
        raise InvalidInput(f"field 'keys' has {len(keys)} keys; the maximum is {limit}")
    for i, k in enumerate(keys if validate else ()):
        try:
            validate_key(k)
        except InvalidInput as e:
            raise type(e)(f"keys[{i}]: {e}") from None
    return keys
