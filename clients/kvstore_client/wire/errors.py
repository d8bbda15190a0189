"""What the wire formats raise: bytes or values that break a format.

Each message says where (the item, the byte offset) and what was expected.
The daemon and the client map these to their own errors in one place each
(kvstore/transport/batchframe.py and kvstore/engine/codec.py; the client's
reads/batch.py, keys.py and record.py).
"""

from __future__ import annotations


class WireError(ValueError):
    """Base: bytes or values that break a wire format."""


class InvalidKey(WireError):
    """A key outside the grammar ``[A-Za-z0-9._~:@=+-]{1,256}``."""


class BadFraming(WireError):
    """A batch stream that breaks the framing."""


class TooLarge(BadFraming):
    """A put item whose data is larger than the reader's limit (``max_block_size``)."""


class CorruptFrame(WireError):
    """A stored frame that does not decode to its plaintext."""


class BadEnvelope(WireError):
    """A record envelope (``GET /v1/records/{key}``) that breaks its format."""


class NewerEnvelope(BadEnvelope):
    """A record envelope of a later release: its magic is ``KVE`` and another version."""


class OtherRecord(WireError):
    """A record envelope of another block than the one asked for: corrupt,
    whatever its frames say."""
