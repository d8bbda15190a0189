"""Small durable-file helpers: atomic replace and directory sync."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed, removed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | Sequence[bytes | memoryview], mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` (bytes, or buffers written one after
    another, never joined) so that a crash leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            _write_all(fd, [data] if isinstance(data, bytes) else data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)  # on a full disk, give its blocks back
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _write_all(fd: int, buffers: Sequence[bytes | memoryview]) -> None:
    """Write every byte of ``buffers`` in order, ``IOV_MAX`` buffers a call
    (a short write, which a regular file gives only near a failure, is
    finished from a join of the rest of that call's buffers)."""
    for i in range(0, len(buffers), _IOV_MAX):
        chunk = buffers[i : i + _IOV_MAX]
        n = os.writev(fd, chunk)
        if n < sum(map(len, chunk)):
            rest = memoryview(b"".join(chunk))[n:]
            while rest:
                rest = rest[os.write(fd, rest) :]
