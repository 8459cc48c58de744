"""EngineLoop on its own, with a scripted fake engine (a unit test of one component): outputs
reach the right stream in order, engine errors reach the caller, and a step that raises fails
every open stream and pending call instead of leaving them hanging."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engine.errors import QueueFull
from engine.llm_engine import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from worker.engine_loop import EngineLoop, EngineLoopFailed


class FakeEngine:
    """Emits one token per step per request, `max_tokens` tokens; step #`fail_at` raises."""

    def __init__(self, fail_at: int | None = None, max_queue: int = 8) -> None:
        self.requests: dict[str, list[Any]] = {}
        self.steps = 0
        self.fail_at = fail_at
        self.max_queue = max_queue
        self.threads: set[str] = set()

    def add_request(self, rid: str, prompt: list[int], sp: SamplingParams, **kw: Any) -> None:
        self.threads.add(threading.current_thread().name)
        if len(self.requests) >= self.max_queue:
            raise QueueFull("full")
        self.requests[rid] = [sp.max_tokens, 0]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("device on fire")
        outs = []
        for rid, state in list(self.requests.items()):
            state[1] += 1
            done = state[1] == state[0]
            outs.append(RequestOutput(rid, [100 + state[1]], done, "length" if done else None,
                                      3, 0, 0, state[1]))
            if done:
                del self.requests[rid]
        return outs

    def abort(self, rid: str) -> bool:
        return self.requests.pop(rid, None) is not None

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests), 0, 0, self.steps, self.steps, 0, None)


async def collect(stream: Any) -> list[int]:
    tokens = []
    while True:
        out = await stream.next(5.0)
        tokens += out.new_token_ids
        if out.finished:
            return tokens


@contextlib.contextmanager
def running(engine: FakeEngine, **kwargs: Any) -> Iterator[EngineLoop]:
    """An engine loop started on `engine`, stopped however the test ends."""
    loop = EngineLoop(engine, **kwargs)  # type: ignore[arg-type]
    loop.start()
    try:
        yield loop
    finally:
        loop.stop()


async def test_streams_get_their_own_outputs_in_order() -> None:
    engine = FakeEngine()
    with running(engine, idle_wait_s=0.01) as loop:
        streams = [await loop.submit(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=i + 1))
                   for i in range(3)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        assert results == [[101], [101, 102], [101, 102, 103]]
        assert engine.threads == {"engine-loop"}
        assert loop.stats.steps_completed == engine.steps


async def test_engine_errors_reach_the_caller() -> None:
    engine = FakeEngine(max_queue=0)
    with running(engine, idle_wait_s=0.01) as loop:
        with pytest.raises(QueueFull):
            await loop.submit("r", [1], SamplingParams(max_tokens=2))
        assert await loop.call(lambda e: 41 + 1) == 42


async def test_a_failing_step_fails_everything_and_sets_failed() -> None:
    engine = FakeEngine(fail_at=2)
    with running(engine, idle_wait_s=0.01) as loop:
        stream = await loop.submit("r", [1], SamplingParams(max_tokens=5))
        with pytest.raises(EngineLoopFailed, match="device on fire"):
            await collect(stream)
        await asyncio.wait_for(loop.failed.wait(), 5)  # type: ignore[union-attr]
        with pytest.raises(EngineLoopFailed):
            await loop.call(lambda e: None)


async def test_a_caller_cancelled_before_its_command_runs_does_not_kill_the_loop() -> None:
    # Found by the mixed load test: a client that went away while its add was queued left a
    # cancelled future; setting its result raised in the engine thread and killed the worker.
    engine = FakeEngine()
    gate = threading.Event()
    with running(engine) as loop:
        blocker = asyncio.ensure_future(loop.call(lambda e: gate.wait(5)))  # holds the thread
        await asyncio.sleep(0.05)
        doomed = asyncio.ensure_future(loop.submit("gone", [1, 2], SamplingParams(max_tokens=3)))
        await asyncio.sleep(0.05)
        doomed.cancel()
        gate.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await doomed
        stream = await loop.submit("alive", [1, 2], SamplingParams(max_tokens=3))
        assert await collect(stream) == [101, 102, 103]
        assert loop.failure is None and "gone" not in engine.requests
