"""The engine is built on a thread that has ended before the engine thread starts, so per-thread
library handles made by the warm-up pass to the engine thread (worker/engine_loop.py)."""

import threading

import pytest

from worker.engine_loop import build_on_a_passing_thread


def test_the_build_runs_on_another_thread_that_has_ended_when_it_returns() -> None:
    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        return 7

    assert build_on_a_passing_thread(build) == 7
    assert seen and seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_a_build_error_is_raised_on_the_callers_thread() -> None:
    class PlanDoesNotFit(RuntimeError):
        pass

    def build() -> None:
        raise PlanDoesNotFit("needs 94.40 GiB, budget is 92.60 GiB")

    with pytest.raises(PlanDoesNotFit, match="92.60"):
        build_on_a_passing_thread(build)
