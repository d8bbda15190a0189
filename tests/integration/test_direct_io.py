"""Segments written with O_DIRECT (direct_io = auto): the records a put
writes never pass through the page cache, every byte reads back (right
after the put, and after a restart), and a filesystem without O_DIRECT
(a real tmpfs) is written through the page cache, said in the log once;
``direct_io = on`` refuses to start there."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
from pathlib import Path

import pytest

from kvstore.buffers import address
from kvstore.config import StoreConfig
from kvstore.engine import directio
from kvstore.engine.crypto import MasterKey
from kvstore.engine.format import ALIGN
from kvstore.engine.store import Store
from kvstore.errors import ConfigError
from tests.fault.smallfs import MiB, mount_tmpfs, unmount

KV = Path(__file__).resolve().parents[2] / "bench" / "data" / "kv"


def _config(root: Path, **settings: object) -> StoreConfig:
    return StoreConfig.from_env(root, env={}, segment_size="64MiB", frame_size="256KiB", **settings)


def _blocks() -> dict[str, bytes]:
    raw = b"".join(p.read_bytes() for p in sorted(KV.glob("*.bin")))
    sizes = [2 << 20, 1, 4095, ALIGN, 300_001, (1 << 20) + 17]
    out, pos = {}, 0
    for i, n in enumerate(sizes):
        out[f"k{i}"] = raw[pos : pos + n]
        pos += n
    return out


def _resident(path: Path) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages), by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = memoryview(m)
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(address(view), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(b & 1 for b in vec), pages
        finally:
            view.release()


def _segments(root: Path, tenant: str) -> list[Path]:
    return sorted((root / "segments" / tenant).glob("*.seg"))


@pytest.mark.parametrize("policy", ["direct", "sealed"])
async def test_a_put_leaves_nothing_in_the_page_cache(tmp_path: Path, master: MasterKey, policy: str) -> None:
    if not directio.supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} does not take O_DIRECT")
    blocks = _blocks()
    cfg = _config(tmp_path / "data")
    async with await Store.open(cfg, master) as s:
        await s.create_tenant("t", policy=policy)
        for k, v in blocks.items():
            assert (await s.put("t", k, v)).created
        (seg,) = _segments(cfg.data_dir, "t")
        cached, pages = _resident(seg)
        # the header page is written through the page cache; every record page is not
        assert pages > len(blocks) and cached <= 1, (cached, pages)
        for k, v in blocks.items():  # read right after the put: from the device
            assert await s.get("t", k) == v
    async with await Store.open(cfg, master) as s:  # and after a restart (recovery scans the records)
        for k, v in blocks.items():
            assert await s.get("t", k) == v


async def test_direct_io_off_writes_through_the_page_cache(tmp_path: Path, master: MasterKey) -> None:
    cfg = _config(tmp_path / "data", direct_io="off")
    async with await Store.open(cfg, master) as s:
        await s.create_tenant("t", policy="direct")
        await s.put("t", "k", os.urandom(1 << 20))
        (seg,) = _segments(cfg.data_dir, "t")
        cached, pages = _resident(seg)
        assert cached == pages


@pytest.fixture
def tmpfs(tmp_path: Path) -> object:
    where = tmp_path / "fs"
    mount_tmpfs(where, 64 * MiB)
    yield where
    unmount(where)


async def test_a_filesystem_without_o_direct(
    tmpfs: Path, master: MasterKey, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(directio, "_probed", {})
    assert directio.filesystem_type(tmpfs) == "tmpfs"
    assert not directio.supported(tmpfs)  # memory: O_DIRECT would save nothing there
    monkeypatch.setattr(directio, "_probed", {})
    with pytest.raises(ConfigError, match="direct_io = on"):
        await Store.open(_config(tmpfs / "on", direct_io="on"), master)
    blocks = _blocks()
    cfg = _config(tmpfs / "auto")
    monkeypatch.setattr(directio, "_probed", {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.engine.directio"):
        async with await Store.open(cfg, master) as s:
            for tenant in ("a", "b"):
                await s.create_tenant(tenant, policy="direct")
                for k, v in blocks.items():
                    await s.put(tenant, k, v)
            for tenant in ("a", "b"):
                for k, v in blocks.items():
                    assert await s.get(tenant, k) == v
    said = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(said) == 1 and "page cache" in said[0].getMessage()


async def test_o_direct_refused_at_open_or_at_write(
    tmp_path: Path, master: MasterKey, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that refuses O_DIRECT (injected: tmpfs is never asked) at
    open (the probe and every segment) for one store, at the first write for
    another. Either way every put is stored and read back, and it is said once."""
    blocks = _blocks()
    real_open, real_pwritev = os.open, os.pwritev

    def refuse_open(path: object, flags: int, *args: int) -> int:
        if flags & directio.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(directio, "_probed", {})
    monkeypatch.setattr(os, "open", refuse_open)
    with pytest.raises(ConfigError, match="direct_io = on"):
        await Store.open(_config(tmp_path / "on", direct_io="on"), master)
    with caplog.at_level(logging.WARNING, logger="kvstore.engine"):
        async with await Store.open(_config(tmp_path / "at-open"), master) as s:
            await s.create_tenant("t", policy="direct")
            for k, v in blocks.items():
                await s.put("t", k, v)
            for k, v in blocks.items():
                assert await s.get("t", k) == v
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(directio, "_probed", {})
    if not directio.supported(tmp_path):
        return
    caplog.clear()

    def refuse_direct_writes(fd: int, views: list[memoryview], offset: int, *flags: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & directio.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, views, offset, *flags)

    monkeypatch.setattr(os, "pwritev", refuse_direct_writes)
    cfg = _config(tmp_path / "at-write")
    with caplog.at_level(logging.WARNING, logger="kvstore.engine"):
        async with await Store.open(cfg, master) as s:
            await s.create_tenant("t", policy="sealed")
            for k, v in blocks.items():
                await s.put("t", k, v)
            for k, v in blocks.items():
                assert await s.get("t", k) == v
    assert len([r for r in caplog.records if "O_DIRECT write" in r.getMessage()]) == 1
