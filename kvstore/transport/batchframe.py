"""The batch framing as the daemon speaks it (``application/x-kvstore-batch``).

The layout, its encoders and its streaming decoders are written once, in
the client distribution's wire module (kvstore_client/wire/batchframe.py,
specified in docs/batch-framing.md). The daemon decodes put streams with
:func:`read_put_items_meta`, which raises the daemon's errors: a malformed
stream is :class:`kvstore.errors.BadFraming` (400), a put item larger than
``max_block_size`` :class:`kvstore.errors.BlockTooLarge` (413), each with the
wire's message (the item, the byte offset, what was wrong); items yielded
before the error were well-formed. The batch route (transport/http/routes/
batch.py) takes the get answer's encoders from here too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from kvstore_client.wire import batchframe as wire
from kvstore_client.wire import errors as wire_errors
from kvstore_client.wire.batchframe import END, MAGIC, Buffer, ByteReader, error_payload, get_item_header

from kvstore.errors import BadFraming, BlockTooLarge

__all__ = ["END", "MAGIC", "error_payload", "get_item_header", "read_put_items_meta"]


async def read_put_items_meta(
    reader: ByteReader, max_block_size: int, max_items: int
) -> AsyncIterator[tuple[str, Buffer, bytes | None]]:
    """:func:`kvstore_client.wire.batchframe.read_put_items_meta` with the daemon's errors."""
    try:
        async for item in wire.read_put_items_meta(reader, max_block_size, max_items):
            yield item
    except wire_errors.TooLarge as e:
        raise BlockTooLarge(str(e)) from None
    except wire_errors.BadFraming as e:
        raise BadFraming(str(e)) from None
