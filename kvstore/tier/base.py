"""The tier protocol: whole-object writes, ranged reads, head, delete, list.

A tier stores immutable-by-convention objects (sealed segments, the tenant
registry) under validated names. Every method is async; backends run their
blocking I/O off the event loop. Every failure is a :class:`~kvstore.errors.TierError`:
:class:`~kvstore.errors.TierUnavailable` (retryable: unreachable, 5xx, throttled),
:class:`~kvstore.errors.TierNotFound` (the object is missing),
:class:`~kvstore.errors.TierConflict` (a conditional write's condition failed),
:class:`~kvstore.errors.TierRangeError` (a read past the end) or a plain
``TierError`` (anything retrying will not fix).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from kvstore.errors import InvalidObjectName, TierError

NAME_MAX_LEN = 1024
_NAME_CHARS = re.compile(r"[A-Za-z0-9._/\-]*")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What :meth:`Tier.head` and :meth:`Tier.list` report about one object.

    ``etag`` changes whenever the object is rewritten; it is opaque (S3's ETag
    without quotes, a stat fingerprint for a directory).
    """

    name: str
    size: int
    etag: str


@runtime_checkable
class Tier(Protocol):
    """One object store. Names are checked by :func:`validate_object_name`."""

    async def put_file(self, name: str, path: Path) -> None:
        """Upload the whole local file ``path`` as ``name``, replacing any object
        of that name; readers see the old object or the new one, never a part."""
        ...

    async def put_bytes(self, name: str, data: bytes) -> None:
        """Store ``data`` as ``name``, replacing any object of that name."""
        ...

    async def put_if(self, name: str, data: bytes, etag: str | None) -> str:
        """Store ``data`` as ``name`` only if the object is still what the
        writer read: ``etag`` None, only if there is no such object (S3's
        ``If-None-Match: *``); else only if its etag is ``etag`` (``If-Match``).
        Returns the new object's etag; :class:`TierConflict` if the condition
        failed (nothing was written). The building block of shared state in
        a bucket (kvstore/fleet/): read, change, ``put_if``, redo on conflict."""
        ...

    async def get(self, name: str) -> tuple[bytes, str] | None:
        """The whole (small) object ``name`` and its etag, read together; None
        if there is no such object."""
        ...

    async def read_range(self, name: str, start: int, length: int) -> bytes:
        """Exactly ``length`` bytes of ``name`` from offset ``start``.

        :class:`TierRangeError` if the range ends past the object, and
        :class:`TierNotFound` if there is no such object.
        """
        ...

    async def head(self, name: str) -> ObjectInfo | None:
        """Size and etag of ``name``, or None if there is no such object."""
        ...

    async def delete(self, name: str) -> None:
        """Remove ``name``; removing a missing object is not an error."""
        ...

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``, sorted by name,
        fetched page by page."""
        ...

    async def close(self) -> None:
        """Release connections and threads; the tier is unusable afterwards."""
        ...


def validate_object_name(name: object) -> str:
    """Return ``name`` if it is a valid object name, else raise :class:`InvalidObjectName`.

    A name is 1-1024 characters of ``[A-Za-z0-9._/-]``: ``/``-separated
    segments, none empty, ``.`` or ``..`` (so no leading or trailing ``/``).
    """
    if not isinstance(name, str):
        raise InvalidObjectName(f"object name must be a string, got {type(name).__name__}")
    if not name:
        raise InvalidObjectName("object name is empty")
    _check(name, "object name")
    if name.endswith("/"):
        raise InvalidObjectName(f"object name {name[:80]!r} ends with '/'")
    return name


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` (for :meth:`Tier.list`) if it is empty or follows the name
    rules, except that it may end with ``/``."""
    if not isinstance(prefix, str):
        raise InvalidObjectName(f"prefix must be a string, got {type(prefix).__name__}")
    if prefix:
        _check(prefix.removesuffix("/"), "prefix")
    return prefix


def _check(name: str, what: str) -> None:
    if len(name) > NAME_MAX_LEN:
        raise InvalidObjectName(f"{what} is {len(name)} characters long; the maximum is {NAME_MAX_LEN}")
    if _NAME_CHARS.fullmatch(name) is None:
        bad = next(c for c in name if _NAME_CHARS.fullmatch(c) is None)
        raise InvalidObjectName(
            f"{what} {name[:80]!r} contains {bad!r} at position {name.index(bad)}; "
            "allowed characters are [A-Za-z0-9._/-]"
        )
    for segment in name.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidObjectName(f"{what} {name[:80]!r} has an empty, '.' or '..' path segment (or a leading '/')")


def check_range(name: str, start: int, length: int) -> None:
    """Reject negative offsets and lengths before any I/O."""
    if start < 0 or length < 0:
        raise TierError(f"bad range for {name!r}: start {start}, length {length}; both must be >= 0")


def source_size(path: Path) -> int:
    """The size of the regular file ``path`` about to be uploaded.

    A missing or unreadable source is the caller's mistake, not a missing
    object: it raises a plain :class:`TierError`.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        raise TierError(f"cannot upload {str(path)!r}: {e.strerror or e}") from e
    if not stat.S_ISREG(st.st_mode):
        raise TierError(f"cannot upload {str(path)!r}: not a regular file")
    return st.st_size
