"""O_DIRECT writes (engine/directio.py): every byte lands where it should,
whatever mix of aligned and unaligned buffers a batch is made of; the
filesystems that refuse O_DIRECT fall back to the page cache."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from kvstore.buffers import POOL, AlignedBuffer, BufferPool, address
from kvstore.engine import directio
from kvstore.engine.directio import pwrite_direct
from kvstore.engine.format import ALIGN

pytestmark = pytest.mark.skipif(not directio.O_DIRECT, reason="this platform has no O_DIRECT")


def _direct_fd(tmp_path: Path) -> tuple[Path, int]:
    path = tmp_path / "f"
    path.write_bytes(b"")
    if not directio.supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} does not take O_DIRECT")
    return path, directio.open_direct(path)


def _aligned(data: bytes) -> memoryview:
    buf = AlignedBuffer(max(len(data), 1))
    buf.memory[: len(data)] = data
    buf.size = len(data)
    return buf.view


def test_mixed_buffers_land_byte_for_byte(tmp_path: Path) -> None:
    path, fd = _direct_fd(tmp_path)
    rng = random.Random(1)
    try:
        for _ in range(30):
            parts: list[bytes | memoryview] = []
            total = 0
            for _ in range(rng.randint(1, 12)):
                n = rng.choice([1, 17, 84, ALIGN - 1, ALIGN, ALIGN + 3, 3 * ALIGN, 1 << 20, (1 << 20) + 5])
                data = rng.randbytes(n)
                parts.append(_aligned(data) if rng.random() < 0.5 else data)
                total += n
            parts.append(bytes(-total % ALIGN))  # a record's padding: the batch ends aligned
            expected = b"".join(bytes(p) for p in parts)
            offset = rng.randrange(0, 64) * ALIGN
            assert pwrite_direct(fd, parts, offset) == len(expected)
            with path.open("rb") as f:
                f.seek(offset)
                assert f.read(len(expected)) == expected
    finally:
        os.close(fd)


def test_a_body_in_aligned_memory_is_not_staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The payload of a direct record goes to the kernel as the caller's own
    memory: the iovec handed to pwritev points at it, only the header is copied."""
    path, fd = _direct_fd(tmp_path)
    body = _aligned(os.urandom(2 << 20))
    header = os.urandom(300) + bytes(ALIGN - 300)
    seen: list[list[int]] = []
    real = os.pwritev

    def spy(fd_: int, views: list[memoryview], off: int) -> int:
        seen.append([address(v) for v in views])
        return real(fd_, views, off)

    monkeypatch.setattr(os, "pwritev", spy)
    try:
        pwrite_direct(fd, [header, body], 0)
    finally:
        os.close(fd)
    assert address(body) in [a for call in seen for a in call]
    assert path.read_bytes() == header + bytes(body)


def test_misaligned_offsets_and_lengths_are_refused(tmp_path: Path) -> None:
    _, fd = _direct_fd(tmp_path)
    try:
        with pytest.raises(ValueError, match="offset"):
            pwrite_direct(fd, [bytes(ALIGN)], 100)
        with pytest.raises(ValueError, match="multiple"):
            pwrite_direct(fd, [bytes(ALIGN + 1)], 0)
    finally:
        os.close(fd)


def test_the_pool_reuses_its_buffers_and_keeps_a_bounded_amount() -> None:
    pool = BufferPool(keep_bytes=256 << 10)
    a = pool.take(100_000)
    assert a.capacity == 128 << 10 and a.size == 100_000 and address(a.memory) % ALIGN == 0
    a.release()
    b = pool.take(70_000)
    assert b is a and b.size == 70_000
    c = pool.take(200_000)
    b.release()
    c.release()  # 128 KiB + 256 KiB: over the bound, c is unmapped
    assert pool.idle_bytes == 128 << 10
    assert POOL.keep_bytes > 0


def test_a_filesystem_without_o_direct_is_said_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_open = os.open

    def refuse(path: object, flags: int, *args: int) -> int:
        if flags & directio.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(directio, "_probed", {})
    assert directio.supported(tmp_path) is False
    assert directio.supported(tmp_path) is False  # asked once per filesystem
    assert not list(tmp_path.iterdir())  # the probe file is gone
