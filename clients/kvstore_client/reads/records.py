"""Records as stored, fetched and decoded here (``decode="client"``/``"auto"``).

``GET /v1/records/{key}`` answers the stored frames that cover the block
(or a range of it); each is checked and decoded (kvstore_client/record.py)
as it arrives, small frames on the event loop, larger ones on the decode
threads. With ``decode="auto"`` an endpoint goes back to GET, for good,
when the daemon refuses (``insecure_transport``: behind a proxy, say) or
when the record is a direct tenant's (raw and unsealed: the daemon sends it
with sendfile and decodes nothing, so GET costs one copy fewer here).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp

from kvstore_client.answers import Miss, check, error_from
from kvstore_client.decoding import Decode, DecodePool
from kvstore_client.errors import ProtocolError, UnavailableError
from kvstore_client.exchange import Exchange

if TYPE_CHECKING:
    from kvstore_client.record import RecordOpener

# Stored frames up to this size are decoded on the event loop (tens of microseconds).
INLINE_DECODE_BYTES = 16 << 10


class ServerDecodes(Exception):
    """The daemon refused to send a record as stored here: GET the block."""


class RecordReader:
    def __init__(self, exchange: Exchange, decoders: DecodePool, decode: Decode) -> None:
        self._x = exchange
        self._decoders = decoders
        self._decode = decode

    def here(self, s: aiohttp.ClientSession) -> bool:
        """Whether reads on ``s`` (an endpoint's session) fetch records as
        stored and decode them here."""
        return any(ep.session is s and ep.client_decode for ep in self._x.endpoints.values())

    def _server_decodes(self, s: aiohttp.ClientSession) -> None:
        """From now on, reads on ``s``'s endpoint leave decoding to the daemon."""
        for ep in self._x.endpoints.values():
            if ep.session is s:
                ep.client_decode = False

    async def read(
        self, s: aiohttp.ClientSession, key: str, rng: tuple[int, int] | None, dest: Callable[[int], memoryview]
    ) -> int:
        """``GET /v1/records/{key}``: the stored frames that cover the block
        (or ``rng``), each checked and decoded on the decode threads as it
        arrives, into ``dest(n)`` (n: the bytes to come). Returns n; raises
        ServerDecodes when the block must be read with GET instead."""
        from kvstore_client import record
        from kvstore_client.wire import envelope

        headers = {"Range": f"bytes={rng[0]}-{rng[1] - 1}"} if rng else {}
        async with s.get(f"/v1/records/{key}", headers=headers) as r:
            if rng is not None and r.status == 416:
                raise Miss
            if r.status == 403 and self._decode == "auto":
                err = error_from(r.status, await r.read(), r)
                if err.code == "insecure_transport":  # behind a proxy, say: the daemon decodes
                    self._server_decodes(s)
                    raise ServerDecodes
                raise err
            await check(r, ok=(200,))
            try:
                with record.client_errors(f"block {key}: ", r.status):
                    meta_len = envelope.meta_len(await r.content.readexactly(envelope.HEAD.size))
                meta = record.parse_meta(await r.content.readexactly(meta_len), key)
                if rng is not None and (meta.start, meta.end) != (rng[0], min(rng[1], meta.size)):
                    raise ProtocolError(f"block {key}: the record sent covers [{meta.start}, {meta.end}), not {rng}")
                if r.content_length is not None and r.content_length != envelope.HEAD.size + meta_len + meta.stored_len:
                    raise ProtocolError(f"block {key}: Content-Length does not match the record envelope")
                if self._decode == "auto" and meta.frame_key is None and all(f.codec == "raw" for f in meta.frames):
                    # A direct tenant: the daemon sends its blocks with sendfile and
                    # decodes nothing, so GET (one copy fewer here) serves it better.
                    self._server_decodes(s)
                opener = record.RecordOpener(meta, dest(meta.end - meta.start))
                await self._open_frames(r, opener)
            except asyncio.IncompleteReadError as e:
                raise UnavailableError(f"block {key}: the answer ended {len(e.partial)} bytes into a part") from None
            self._x.stats["client_decodes"] += 1
            return meta.end - meta.start

    async def _open_frames(self, r: aiohttp.ClientResponse, opener: RecordOpener) -> None:
        """Each frame of the answer, read and handed to a decode thread; every
        thread has finished with the output when this returns or raises."""
        loop = asyncio.get_running_loop()
        pool = self._decoders.get()
        pending: list[asyncio.Future[None]] = []
        try:
            for j, f in enumerate(opener.meta.frames):
                stored = await r.content.readexactly(f.length)
                if f.length <= INLINE_DECODE_BYTES:  # cheaper here than the hop to a thread
                    opener.place(j, stored)
                else:
                    pending.append(loop.run_in_executor(pool, opener.place, j, stored))
            if await r.content.read(1):
                raise ProtocolError(f"block {opener.meta.key}: bytes after the record's last frame")
        finally:
            if pending:  # the output is the caller's buffer: no thread may write to it after we return
                await asyncio.shield(asyncio.wait(pending))
        for fut in pending:
            fut.result()
