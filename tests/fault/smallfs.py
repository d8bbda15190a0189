"""A real small filesystem for disk-full tests: a tmpfs the test mounts.

Mounting needs root (CAP_SYS_ADMIN); where the test cannot mount, it skips
and says why. The filesystem is unmounted (lazily: a daemon killed by the
test may still hold files) when the test ends.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

MiB = 1 << 20


def mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {size >> 20} MiB tmpfs for a real disk-full test: {r.stderr.strip()}")


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem is full (another process taking
    the last byte, as happens on a shared disk); the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    written = 0
    chunk = b"\0" * (64 << 10)
    try:
        while True:
            try:
                written += os.write(fd, chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 4096:
                    return written
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
