"""Liveness from engine progress (router/liveness.py): plain data in, plain data out."""

from __future__ import annotations

from router.liveness import LivenessState, Progress, judge_liveness

STALL_S = 120.0


def busy(steps: int, tokens: int) -> Progress:
    return Progress(steps_completed=steps, tokens_advanced=tokens, num_running=1, num_waiting=2)


def idle(steps: int, tokens: int) -> Progress:
    return Progress(steps_completed=steps, tokens_advanced=tokens, num_running=0, num_waiting=0)


def test_stalled_with_work_is_unhealthy_after_the_timeout() -> None:
    first = judge_liveness(None, busy(10, 500), 0.0, STALL_S)
    assert first.is_alive and first.state == LivenessState(10, 500, 0.0)
    before = judge_liveness(first.state, busy(10, 500), STALL_S - 1, STALL_S)
    assert before.is_alive and before.state.since_s == 0.0  # the stall clock keeps running
    after = judge_liveness(before.state, busy(10, 500), STALL_S + 1, STALL_S)
    assert not after.is_alive
    assert "stalled" in after.problem and "steps_completed=10" in after.problem
    # The problem string does not change while the stall lasts: it is logged once.
    later = judge_liveness(after.state, busy(10, 500), STALL_S + 60, STALL_S)
    assert not later.is_alive and later.problem == after.problem


def test_busy_and_advancing_stays_healthy_for_longer_than_the_timeout() -> None:
    # A 1M-token prefill: one chunk per step, minutes in all, GetInfo slow or not.
    state = judge_liveness(None, busy(0, 0), 0.0, STALL_S).state
    for i in range(1, 30):
        verdict = judge_liveness(state, busy(i, i * 4096), i * 30.0, STALL_S)
        assert verdict.is_alive and verdict.problem == ""
        state = verdict.state
    assert state.since_s == 29 * 30.0


def test_tokens_alone_count_as_progress() -> None:
    state = judge_liveness(None, busy(5, 100), 0.0, STALL_S).state
    verdict = judge_liveness(state, busy(5, 101), STALL_S * 2, STALL_S)
    assert verdict.is_alive and verdict.state.since_s == STALL_S * 2


def test_idle_is_healthy_however_long_the_counters_stand_still() -> None:
    state = judge_liveness(None, idle(7, 70), 0.0, STALL_S).state
    verdict = judge_liveness(state, idle(7, 70), 10 * STALL_S, STALL_S)
    assert verdict.is_alive
    # Work arriving after a long idle time starts the stall clock then, not at the last step.
    verdict = judge_liveness(verdict.state, busy(7, 70), 10 * STALL_S + 1, STALL_S)
    assert verdict.is_alive and verdict.state.since_s == 10 * STALL_S


def test_a_restarted_worker_is_a_new_baseline_not_a_stall() -> None:
    state = judge_liveness(None, busy(1000, 90000), 0.0, STALL_S).state
    verdict = judge_liveness(state, busy(3, 40), STALL_S + 5, STALL_S)
    assert verdict.is_alive and verdict.state == LivenessState(3, 40, STALL_S + 5)


def test_recovers_once_the_counters_move_again() -> None:
    state = judge_liveness(None, busy(1, 1), 0.0, STALL_S).state
    stalled = judge_liveness(state, busy(1, 1), STALL_S, STALL_S)
    assert not stalled.is_alive
    assert judge_liveness(stalled.state, busy(2, 17), STALL_S + 1, STALL_S).is_alive
