"""Background tasks stop when their owner closes, whatever they await.

Python 3.11's ``asyncio.wait_for`` loses a cancellation that arrives in the
same loop iteration as the event it waits for; the evictor's loop then ran on
after ``Store.close`` cancelled it, and close waited for it forever (a CI hang
right after a flush, whose last upload wakes the evictor)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvstore.tasks import Background, wait_event

BOUND_S = 5.0  # far above what any of these needs; reaching it is the failure


async def _wake_loop(event: asyncio.Event, passes: list[int]) -> None:
    """The evictor's shape: wait for a wake-up or a timer, work, again."""
    while True:
        await wait_event(event, 2.0)
        event.clear()
        passes.append(1)
        await asyncio.sleep(0)


async def test_a_loop_woken_as_it_is_cancelled_still_stops() -> None:
    for _ in range(20):
        bg = Background()
        event, passes = asyncio.Event(), []
        bg.spawn(_wake_loop(event, passes), "waker")
        await asyncio.sleep(0.001)
        event.set()  # the wake-up and the cancellation in one loop iteration
        closing = asyncio.ensure_future(bg.close())
        done, _ = await asyncio.wait({closing}, timeout=BOUND_S)
        assert done, "Background.close did not end: a cancellation was lost"


async def test_close_cancels_again_a_task_that_swallowed_its_cancellation() -> None:
    swallowed = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(1)  # as a library that catches too much would
        await asyncio.sleep(3600)

    bg = Background()
    task = bg.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(bg.close())
    done, _ = await asyncio.wait({closing}, timeout=BOUND_S)
    assert done, "Background.close did not end: it cancelled the task only once"
    assert swallowed == [1] and task.cancelled()


async def test_close_raises_its_callers_cancellation() -> None:
    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.shield(asyncio.sleep(0.3))

    bg = Background()
    bg.spawn(slow_to_stop(), "slow")
    await asyncio.sleep(0)
    closer = asyncio.ensure_future(bg.close())
    await asyncio.sleep(0.05)
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer


async def test_wait_event() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, BOUND_S) is True
    waiter = asyncio.ensure_future(wait_event(asyncio.Event(), 3600))
    await asyncio.sleep(0)
    waiter.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiter
    assert waiter.cancelled()


async def test_every_runs_on_after_a_failing_step(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def step() -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("boom")

    tasks = Background()
    tasks.every(0.01, step, "test-step")
    for _ in range(200):
        if len(calls) >= 4:
            break
        await asyncio.sleep(0.01)
    await tasks.close()
    assert len(calls) >= 4
    assert "test-step: a periodic step failed" in caplog.text
    n = len(calls)
    await asyncio.sleep(0.05)
    assert len(calls) == n  # closed: no step after
