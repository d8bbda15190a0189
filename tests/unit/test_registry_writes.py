"""A registry change is all or nothing: when the file cannot be written
(ENOSPC, EIO), memory goes back to what the file says.

Regression (issue 24, found while making removals work on a full disk):
``delete`` dropped the tenant from memory before the file write failed, so
the retry after the space reserve was released answered "tenant does not
exist" while the file (and every restart) still had it; an ``issue_token``
that failed the same way left a token that worked until the next restart.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore.engine.registry
from kvstore.engine.crypto import MasterKey
from kvstore.engine.registry import Registry


@pytest.fixture
def failing_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Each errno put in the list fails the next registry write with it."""
    pending: list[int] = []
    real = kvstore.engine.registry.atomic_write

    def write(path: Path, data: bytes, mode: int = 0o600) -> None:
        if pending:
            code = pending.pop(0)
            raise OSError(code, os.strerror(code))
        real(path, data, mode)

    monkeypatch.setattr(kvstore.engine.registry, "atomic_write", write)
    yield pending


def test_a_failed_write_leaves_memory_as_the_file(tmp_path: Path, failing_writes: list[int]) -> None:
    master = MasterKey(os.urandom(32))
    reg = Registry(tmp_path / "registry.json", master)
    reg.create("a")
    _, token = reg.issue_token("a")

    failing_writes.append(errno.ENOSPC)
    with pytest.raises(OSError):
        reg.issue_token("a")
    assert len(reg.get("a").tokens) == 1  # the token that failed to be written is not usable

    failing_writes.append(errno.ENOSPC)
    with pytest.raises(OSError):
        reg.delete("a")
    assert "a" in reg and reg.tenant_for_token(token) == "a" and reg.data_key("a", 1)
    reg.delete("a")  # the retry does it
    assert "a" not in reg and reg.tenant_for_token(token) is None

    reg.create("b", "direct", "none", "ephemeral")
    failing_writes.append(errno.EIO)
    with pytest.raises(OSError):
        reg.set_limits("b", quota_bytes=100)
    assert reg.get("b").quota_bytes == 0

    new_master = MasterKey(os.urandom(32))
    reg.create("c")
    key = reg.data_key("c", 1)
    failing_writes.append(errno.ENOSPC)
    with pytest.raises(OSError):
        reg.rotate_master(new_master)
    assert Registry(tmp_path / "registry.json", master).data_key("c", 1) == key  # still under the old key
    reg.rotate_master(new_master)
    assert Registry(tmp_path / "registry.json", new_master).data_key("c", 1) == key
    assert not list(tmp_path.glob("*.tmp"))
