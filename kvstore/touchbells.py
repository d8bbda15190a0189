"""The readers' accesses, in the writer's hands before it picks victims.

A reader worker serves reads and hands the writer the accesses it served
every ``RELAY_S`` (transport/http/internal.py). The quota's LRU order is the
writer's; without more, a block read on a reader a moment before the quota
is enforced looked a second older than it was, and went before blocks read
long before (with two workers ``lru`` lost 5-17% of LRU's hit ratio).

So before it picks victims the writer rings each reader's bell: an eventfd
per reader, made by the supervisor before it forks (:func:`bells`). A reader
wakes on its bell at once (no polling), reads it (how many rings it has
taken in all) and then hands the writer its accesses, saying how many rings
it had taken; the writer waits until every reader has answered the ring it
sent (an answer drained after the ring holds every access served before
it), for at most ``WAIT_S`` (a reader stuck or gone never holds up a put
for longer; its accesses then come with its next relay, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("kvstore.touchbells")
WAIT_S = 0.2


def bells(readers: int) -> tuple[int, ...]:
    """One eventfd per reader, inherited by every worker (the supervisor's)."""
    return tuple(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(readers))


def close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        os.close(fd)


class Ringer:
    """The writer's side: rings every reader's bell and waits for the answers."""

    def __init__(self, fds: tuple[int, ...]) -> None:
        self._fds = fds
        self._rung = [0] * len(fds)  # rings sent to each reader
        self._answered = [0] * len(fds)  # the most rings a reader said it had taken when it answered
        self._changed = asyncio.Event()

    async def sync(self) -> None:
        """Ring every reader and wait (at most ``WAIT_S``) until each has
        handed over the accesses it served before the ring."""
        for i, fd in enumerate(self._fds):
            self._rung[i] += 1
            try:
                os.eventfd_write(fd, 1)
            except OSError as e:  # the counter cannot overflow in practice; never fail a put for it
                log.warning("ringing reader %d failed: %s", i, e)
        deadline = time.monotonic() + WAIT_S
        while not all(a >= r for a, r in zip(self._answered, self._rung, strict=True)):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def answered(self, reader: int, taken: int) -> None:
        """Reader ``reader`` handed over its accesses after taking ``taken`` rings."""
        if 0 <= reader < len(self._answered) and taken > self._answered[reader]:
            self._answered[reader] = taken
            self._changed.set()


class Bell:
    """A reader's side: its bell on the event loop, and the rings taken."""

    def __init__(self, fd: int, index: int) -> None:
        self.fd = fd
        self.index = index
        self.taken = 0

    def listen(self, loop: asyncio.AbstractEventLoop, rung: Callable[[], None]) -> None:
        """Call ``rung()`` on the loop each time the writer rings (the rings
        are counted first, so what ``rung`` hands over answers them)."""

        def on_ring() -> None:
            try:
                self.taken += os.eventfd_read(self.fd)
            except BlockingIOError:
                return  # another worker's read took it first: not ours (each reader has its own bell)
            rung()

        loop.add_reader(self.fd, on_ring)

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.fd)
