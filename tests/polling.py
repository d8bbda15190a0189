"""Waiting in tests for a condition, not for a time.

A fixed sleep is either too short on a loaded machine (a flaky test) or too
long on a fast one (a slow suite); :func:`until` polls the condition itself
and fails, naming it, only after a generous deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(what: str, ready: Callable[[], bool | Awaitable[bool]], timeout_s: float = 15.0) -> None:
    """Wait for ``ready()`` (a plain or async check) to hold, polling; fail
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = ready()
        if got if isinstance(got, bool) else await got:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def until_now(what: str, ready: Callable[[], bool], timeout_s: float = 15.0, every_s: float = 0.05) -> None:
    """:func:`until` for a test that has no event loop: a plain check, polled."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(every_s)
