"""The caller's buffers as request bodies and as destinations of reads: no copies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp.abc
import aiohttp.payload


class BuffersPayload(aiohttp.payload.Payload):
    """A request body made of buffers (bytes, memoryviews, numpy arrays), sent
    as they are: no join, no copy; written in slices so that flow control applies."""

    _CHUNK = 1 << 20

    def __init__(self, parts: Sequence[Any], content_type: str) -> None:
        views = [byte_view(p) for p in parts]
        super().__init__(views, content_type=content_type)
        self._views = views
        self._size = sum(v.nbytes for v in views)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._views).decode(encoding, errors)

    async def write(self, writer: aiohttp.abc.AbstractStreamWriter) -> None:
        for v in self._views:
            for at in range(0, v.nbytes, self._CHUNK):
                await writer.write(v[at : at + self._CHUNK])


def byte_view(buf: Any) -> memoryview:
    """``buf`` as a flat view of bytes (TypeError unless C-contiguous)."""
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise TypeError("blocks must be C-contiguous buffers")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def writable_view(buf: Any) -> memoryview:
    """``buf`` as a flat writable view of bytes: where ``get_into`` writes."""
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError("get_into needs a writable buffer")
    if not mv.c_contiguous:
        raise TypeError("get_into needs a C-contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
