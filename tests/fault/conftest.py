"""Fixtures of the fault tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault.smallfs import MiB, mount_tmpfs, unmount


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs mounted for this test (skips where it cannot mount)."""
    where = tmp_path / "fs"
    mount_tmpfs(where, 48 * MiB)
    yield where
    unmount(where)
