"""A tier in a local directory: tests, and NFS-style storage shared by nodes.

Object ``a/b`` is the file ``root/a/b``. Writes go to a temporary file in the
same directory (named with ``~``, which no object name contains), are fsynced,
renamed over the target and the directory fsynced, so a reader or a crash sees
the old object or the new one whole. Blocking I/O runs in a thread
(:func:`asyncio.to_thread`). :func:`_map_os_error` is the one place where OS
errors become tier errors.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import fcntl
import os
import secrets
import shutil
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from kvstore.errors import TierConflict, TierError, TierNotFound, TierRangeError, TierUnavailable
from kvstore.fsutil import fsync_dir
from kvstore.tier.base import ObjectInfo, check_range, source_size, validate_object_name, validate_prefix

# Errors of a shared filesystem that is away for now (NFS server down, stale
# handle after a failover, a full or failing volume) rather than a wrong call.
_TRANSIENT = frozenset(
    {errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.ENOLCK}
)
_FILE_MODE = 0o600
LOCK_FILE = "~conditional-writes.lock"  # "~": no object name contains it, and list() skips it


class LocalTier:
    """:class:`~kvstore.tier.base.Tier` over the directory ``root`` (created if missing)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalTier({str(self.root)!r})"

    # -- writes ------------------------------------------------------------------

    async def put_file(self, name: str, path: Path) -> None:
        validate_object_name(name)
        source_size(path)
        await asyncio.to_thread(self._put, name, lambda fd: _copy_into(path, fd))

    async def put_bytes(self, name: str, data: bytes) -> None:
        validate_object_name(name)
        await asyncio.to_thread(self._put, name, lambda fd: _write_all(fd, data))

    def _put(self, name: str, fill: Callable[[int], None]) -> None:
        target = self.root / name
        tmp = target.with_name(f"{target.name}~{secrets.token_hex(6)}.tmp")
        with _map_os_error(name):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
            try:
                try:
                    fill(fd)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, target)
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp)
                raise
            fsync_dir(target.parent)

    async def put_if(self, name: str, data: bytes, etag: str | None) -> str:
        validate_object_name(name)
        return await asyncio.to_thread(self._put_if, name, data, etag)

    def _put_if(self, name: str, data: bytes, etag: str | None) -> str:
        # One writer at a time per tier directory (an flock on a lock file, which
        # NFS v4 honours too): read the etag, compare, rename the new file in.
        with _map_os_error(name):
            fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, _FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                current = self._head(name)
                if (current is None) != (etag is None) or (current is not None and current.etag != etag):
                    want = "no object" if etag is None else f"etag {etag}"
                    have = "none" if current is None else f"etag {current.etag}"
                    raise TierConflict(f"conditional write of {name!r}: expected {want}, found {have}")
                self._put(name, lambda out: _write_all(out, data))
                after = self._head(name)
                assert after is not None
                return after.etag
            finally:
                os.close(fd)  # (releases the lock)

    async def get(self, name: str) -> tuple[bytes, str] | None:
        validate_object_name(name)
        return await asyncio.to_thread(self._get, name)

    def _get(self, name: str) -> tuple[bytes, str] | None:
        with _map_os_error(name):
            try:
                fd = os.open(self.root / name, os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):
                return None
            try:
                st = os.fstat(fd)  # the etag of the file read (a put renames a new one in)
                if not stat.S_ISREG(st.st_mode):
                    return None
                chunks, at = [], 0
                while chunk := os.pread(fd, 1 << 20, at):
                    chunks.append(chunk)
                    at += len(chunk)
                return b"".join(chunks), _etag(st)
            finally:
                os.close(fd)

    async def delete(self, name: str) -> None:
        validate_object_name(name)
        await asyncio.to_thread(self._delete, name)

    def _delete(self, name: str) -> None:
        path = self.root / name
        with _map_os_error(name):
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            fsync_dir(path.parent)

    # -- reads -------------------------------------------------------------------

    async def read_range(self, name: str, start: int, length: int) -> bytes:
        validate_object_name(name)
        check_range(name, start, length)
        return await asyncio.to_thread(self._read_range, name, start, length)

    def _read_range(self, name: str, start: int, length: int) -> bytes:
        with _map_os_error(name):
            fd = os.open(self.root / name, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if start + length > size:
                    raise TierRangeError(f"range {start}+{length} of {name!r} ends past its size {size}", size=size)
                data = os.pread(fd, length, start)
                while len(data) < length:  # short reads: signals, network filesystems
                    more = os.pread(fd, length - len(data), start + len(data))
                    if not more:  # truncated under us: not a whole object any more
                        raise TierRangeError(f"{name!r} shrank to {start + len(data)} bytes while being read")
                    data += more
                return data
            finally:
                os.close(fd)

    async def head(self, name: str) -> ObjectInfo | None:
        validate_object_name(name)
        return await asyncio.to_thread(self._head, name)

    def _head(self, name: str) -> ObjectInfo | None:
        with _map_os_error(name):
            try:
                st = os.stat(self.root / name)
            except (FileNotFoundError, NotADirectoryError):
                return None
            if not stat.S_ISREG(st.st_mode):
                return None
            return ObjectInfo(name, st.st_size, _etag(st))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        validate_prefix(prefix)
        infos = await asyncio.to_thread(self._list, prefix)
        for info in infos:
            yield info

    def _list(self, prefix: str) -> builtins.list[ObjectInfo]:
        # Walk only the directory the prefix names, then filter and sort by the
        # whole name: S3's order ("a.b" < "a/b"), not the walk's.
        head, _, _ = prefix.rpartition("/")
        top = self.root / head if head else self.root
        out: builtins.list[ObjectInfo] = []
        with _map_os_error(prefix or "/"):
            for dirpath, _dirs, files in os.walk(top):
                for fname in files:
                    if "~" in fname:  # a write in flight
                        continue
                    full = Path(dirpath) / fname
                    name = full.relative_to(self.root).as_posix()
                    if not name.startswith(prefix):
                        continue
                    try:
                        st = full.stat()
                    except FileNotFoundError:  # deleted since the walk saw it
                        continue
                    out.append(ObjectInfo(name, st.st_size, _etag(st)))
        out.sort(key=lambda info: info.name)
        return out

    async def close(self) -> None:
        return None


def _etag(st: os.stat_result) -> str:
    # Every put renames a new file in: a new inode and mtime, so a new etag.
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _copy_into(path: Path, fd: int) -> None:
    try:
        src = open(path, "rb")  # noqa: SIM115 - closed below, errors told apart from the target's
    except OSError as e:
        raise TierError(f"cannot upload {str(path)!r}: {e.strerror or e}") from e
    with src, open(fd, "wb", closefd=False) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


@contextmanager
def _map_os_error(name: str) -> Iterator[None]:
    """The one place where this backend's OS errors become tier errors."""
    try:
        yield
    except TierError:
        raise
    except (FileNotFoundError, NotADirectoryError) as e:
        raise TierNotFound(f"no object {name!r} in the local tier") from e
    except IsADirectoryError as e:
        raise TierError(f"{name!r} names a directory in the local tier, not an object") from e
    except OSError as e:
        cls = TierUnavailable if e.errno in _TRANSIENT else TierError
        raise cls(f"local tier: {name!r}: {e.strerror or e}") from e
