"""atomic_write of buffers (the registry's parts, never joined): the file
holds them back to back, in more buffers than one writev takes, and a short
write (injected) is finished, not lost."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore import fsutil


def _parts(n: int) -> list[bytes | memoryview]:
    return [memoryview(b"head")[1:], *(f"part{i}, ".encode() for i in range(n)), b"", b"tail"]


def test_buffers_are_written_back_to_back(tmp_path: Path) -> None:
    parts = _parts(3 * fsutil._IOV_MAX + 7)
    fsutil.atomic_write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "f.tmp").exists()


def test_a_short_writev_is_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev

    def short(fd: int, buffers: list[bytes]) -> int:  # writes the first buffer only, then half of the next
        first = real(fd, buffers[:1])
        return first + (real(fd, [bytes(buffers[1])[: len(buffers[1]) // 2]]) if len(buffers) > 1 else 0)

    monkeypatch.setattr(fsutil.os, "writev", short)
    parts = _parts(2 * fsutil._IOV_MAX)
    fsutil.atomic_write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
