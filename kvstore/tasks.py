"""Background tasks that live until they end or their owner closes, and a
wait on an event that never swallows a cancellation.

Python 3.11's ``asyncio.wait_for`` returns normally when the awaited event is
set in the same loop iteration as its task is cancelled: the cancellation is
lost (fixed in 3.12). A ``while True`` loop around it then never stops, and
whoever awaits it on shutdown waits forever. Nothing in kvstore waits with
``wait_for``; it uses :func:`wait_event` (``asyncio.timeout``, which keeps
cancellations), and :meth:`Background.close` cancels again until every task
has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger("kvstore.tasks")
CLOSE_RECANCEL_S = 0.5  # a task still running this long after a cancel is cancelled again


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True if set.
    A cancellation of the caller is always raised."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


class Background:
    """A set of tasks: finished ones are forgotten; :meth:`close` cancels the
    rest and waits for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def every(self, interval_s: float, step: Callable[[], object], name: str) -> asyncio.Task[Any]:
        """Run ``step`` every ``interval_s`` seconds (the first after one
        interval) until closed; a step that fails is logged, and the next runs."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    step()
                except Exception:
                    log.exception("%s: a periodic step failed", name)

        return self.spawn(loop(), name)

    async def close(self) -> None:
        """Cancel every task and wait until all have ended; a task that
        swallowed its cancellation is cancelled again. The caller's own
        cancellation is raised, never taken for a task's."""
        pending = set(self._tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=CLOSE_RECANCEL_S)
