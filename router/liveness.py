"""Whether a worker is alive, judged from its engine's progress, not from how fast it answers.

A worker in the middle of a 1M-token prefill answers GetInfo slowly and streams nothing for
minutes, yet it is alive as long as its engine keeps completing steps. So the rule is: a worker
with no work is alive; a worker with work (``num_running + num_waiting > 0``) is alive while its
progress counters (``steps_completed``, ``tokens_advanced``) change; once they have not changed
for ``stall_timeout_s`` while it had work, it is stalled and must not be routed to. Whether its
heartbeat key exists is decided before this (a worker whose key expired is dropped altogether).

This module must never do I/O or read a clock: plain data in, plain data out (the caller passes
the time), so it is tested as a function.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """One observation of a worker's engine (the counters and load of one WorkerInfo)."""

    steps_completed: int
    tokens_advanced: int
    num_running: int
    num_waiting: int

    @property
    def has_work(self) -> bool:
        return self.num_running + self.num_waiting > 0


@dataclass(frozen=True)
class LivenessState:
    """What the router remembers of a worker between observations."""

    steps_completed: int
    tokens_advanced: int
    since_s: float   # when the counters last changed, or the worker was last seen without work


@dataclass(frozen=True)
class Liveness:
    is_alive: bool
    problem: str             # '' when alive; stable while the stall lasts (logged once)
    state: LivenessState     # pass back as `prev` with the next observation


def judge_liveness(prev: LivenessState | None, seen: Progress, now_s: float,
                   stall_timeout_s: float) -> Liveness:
    """Judge one observation against the previous state.

    Counters that changed in any direction count as progress: a lower value is a restarted
    worker, whose new counters are the new baseline.
    """
    advanced = prev is None or (seen.steps_completed, seen.tokens_advanced) != (
        prev.steps_completed, prev.tokens_advanced)
    if advanced or not seen.has_work:
        return Liveness(True, "", LivenessState(seen.steps_completed, seen.tokens_advanced, now_s))
    assert prev is not None
    if now_s - prev.since_s < stall_timeout_s:
        return Liveness(True, "", prev)
    return Liveness(False, (
        f"stalled: has work but its engine made no progress (steps_completed="
        f"{seen.steps_completed}, tokens_advanced={seen.tokens_advanced}) for over "
        f"{stall_timeout_s:g} s"), prev)
