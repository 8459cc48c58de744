"""Watching the worker a request waits on: has it stopped advancing?

A Prefill RPC to a frozen worker (SIGSTOPped, its engine thread wedged) neither answers nor
fails until its deadline (`prefill_timeout_s`, minutes).  The registry already knows how to tell
a stalled worker from a slow one: its engine progress counters (router/liveness.py).  This
applies the same rule to the one worker a request is on, counting our request as work (a
worker frozen before its next report still looks idle to the registry), so the caller can give
up on it after `stall_timeout_s` without progress and retry elsewhere.  This module never calls
a worker itself: it reads what the registry's polls and heartbeats already observed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.liveness import LivenessState, Progress, judge_liveness
from router.worker_status import WorkerStatus


@dataclass(frozen=True)
class StallWatch:
    """`health(address)`: '' while the registry routes to it, else its problem; `info(address)`:
    its last WorkerStatus (poll or heartbeat) or None."""

    health: Callable[[str], str]
    info: Callable[[str], WorkerStatus | None]
    stall_timeout_s: float
    interval_s: float

    async def wait(self, address: str) -> str:
        """Return (why) once `address` is out of routing or made no progress for
        `stall_timeout_s` while our request was on it; never returns while it advances."""
        state: LivenessState | None = None
        while True:
            problem = self.health(address)
            if problem:
                return problem
            info = self.info(address)
            if info is not None:
                seen = Progress(info.steps_completed, info.tokens_advanced,
                                max(1, info.num_running), info.num_waiting)
                verdict = judge_liveness(state, seen, time.monotonic(), self.stall_timeout_s)
                if not verdict.is_alive:
                    return verdict.problem
                state = verdict.state
            await asyncio.sleep(self.interval_s)
