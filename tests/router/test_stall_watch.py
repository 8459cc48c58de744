"""StallWatch: gives up on a worker whose counters stop while our request is on it, or that the
registry takes out of routing; never on one that keeps advancing."""

from __future__ import annotations

import asyncio
import time

from router.stall_watch import StallWatch
from router.worker_status import WorkerStatus


def _info(steps: int, running: int = 0) -> WorkerStatus:
    return WorkerStatus(steps_completed=steps, tokens_advanced=steps * 10, num_running=running)


async def test_frozen_counters_are_a_stall_even_when_the_last_report_says_idle() -> None:
    # frozen before it reported our request: num_running 0, yet it has our work
    watch = StallWatch(lambda a: "", lambda a: _info(7, running=0), stall_timeout_s=0.3,
                       interval_s=0.02)
    started = time.monotonic()
    problem = await asyncio.wait_for(watch.wait("w:1"), 5)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert "no progress" in problem and "steps_completed=7" in problem


async def test_advancing_counters_are_never_a_stall() -> None:
    steps = [0]

    def info(address: str) -> WorkerStatus:
        steps[0] += 1
        return _info(steps[0], running=1)

    watch = StallWatch(lambda a: "", info, stall_timeout_s=0.1, interval_s=0.02)
    task = asyncio.ensure_future(watch.wait("w:1"))
    await asyncio.sleep(0.5)
    assert not task.done()
    task.cancel()


async def test_out_of_routing_ends_the_wait_at_once() -> None:
    watch = StallWatch(lambda a: "GetInfo failed: UNAVAILABLE", lambda a: None,
                       stall_timeout_s=100.0, interval_s=0.02)
    assert await asyncio.wait_for(watch.wait("w:1"), 1) == "GetInfo failed: UNAVAILABLE"
