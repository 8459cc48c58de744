"""common/periodic.py: the loop runs its step every interval, survives a failing step, and stops
when asked even if the step swallows the cancellation (as a client's own timeout can)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from common.periodic import Periodic


async def test_steps_repeat_and_a_failing_step_does_not_end_the_loop() -> None:
    calls: list[float] = []

    async def step() -> None:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise RuntimeError("one bad beat")

    loop = Periodic(step, 0.02, "test loop")
    loop.start()
    await asyncio.sleep(0.3)
    assert await loop.stop()
    assert len(calls) >= 4 and not loop.running
    n = len(calls)
    await asyncio.sleep(0.1)
    assert len(calls) == n, "the loop stepped after stop()"


async def test_stop_returns_when_the_step_swallows_the_cancel() -> None:
    started = asyncio.Event()

    async def stubborn_step() -> None:
        started.set()
        # swallowing the cancel is what a client turning it into a TimeoutError does
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.2)

    loop = Periodic(stubborn_step, 0.01, "stubborn loop")
    loop.start()
    await started.wait()
    t0 = time.monotonic()
    assert await asyncio.wait_for(loop.stop(), 2.0)
    assert time.monotonic() - t0 < 1.0


async def test_stop_is_bounded_when_the_step_never_ends() -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def stuck_step() -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    loop = Periodic(stuck_step, 0.01, "stuck loop")
    loop.start()
    await started.wait()
    t0 = time.monotonic()
    assert not await loop.stop(wait_s=0.2)
    assert time.monotonic() - t0 < 1.0
    release.set()  # let the abandoned step end so the test's loop can close
    await asyncio.sleep(0.05)


async def test_stop_before_start_and_twice_is_harmless() -> None:
    async def step() -> None:
        pass

    loop = Periodic(step, 0.05, "idle loop")
    assert await loop.stop()
    loop2 = Periodic(step, 0.05, "loop")
    loop2.start()
    assert await loop2.stop() and await loop2.stop()
