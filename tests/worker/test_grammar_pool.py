"""The worker's grammar pool: identical schemas share one compile and its cached result; distinct
compiles are capped; a compile past its time limit is a 400 naming the limit while it keeps its
slot until it ends; one that cannot start in time is a retry-later; a queued compile whose
client went never runs; and the loop's default executor (the KV-store fetch) never waits behind
compiles. The cache's compile is replaced by one that blocks until released (no xgrammar)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from engine.errors import InvalidRequest, QueueFull
from worker.grammar_cache import GrammarCache
from worker.grammar_pool import GrammarPool, GrammarPoolConfig


class HeldCache(GrammarCache):
    """Compiles (kind, spec) to ("compiled", spec) once ``release`` is set."""

    def __init__(self) -> None:
        super().__init__("unused", 100, (0,))
        self.release = threading.Event()
        self.calls: list[str] = []

    def compile(self, kind: str, spec: str) -> Any:
        self.calls.append(spec)
        self.release.wait(30)
        with self._lock:
            self._cache[(kind, spec)] = ("compiled", spec)
        return ("compiled", spec)


def pool(**kw: Any) -> tuple[GrammarPool, HeldCache]:
    cache = HeldCache()
    return GrammarPool(cache, GrammarPoolConfig(**kw)), cache


async def test_identical_schemas_share_one_compile_and_then_the_cache() -> None:
    p, cache = pool(max_concurrent=1, max_waiting=0)
    tasks = [asyncio.create_task(p.compile("json_schema", "{}")) for _ in range(5)]
    await asyncio.sleep(0.1)
    cache.release.set()
    assert await asyncio.gather(*tasks) == [("compiled", "{}")] * 5
    assert await p.compile("json_schema", "{}") == ("compiled", "{}")
    assert cache.calls == ["{}"]
    p.close()


async def test_distinct_compiles_past_the_cap_are_refused_at_once() -> None:
    p, cache = pool(max_concurrent=1, max_waiting=1)
    a = asyncio.create_task(p.compile("json_schema", "a"))
    b = asyncio.create_task(p.compile("json_schema", "b"))
    await asyncio.sleep(0.1)
    with pytest.raises(QueueFull, match="2 grammar compiles"):
        await p.compile("json_schema", "c")
    cache.release.set()
    assert [x[1] for x in await asyncio.gather(a, b)] == ["a", "b"]
    p.close()


async def test_a_compile_past_the_limit_is_a_400_and_keeps_its_slot() -> None:
    p, cache = pool(max_concurrent=1, max_waiting=0, timeout_s=0.3)
    with pytest.raises(InvalidRequest, match=r"longer than the limit of 0.3 s") as info:
        await p.compile("json_schema", "slow")
    assert info.value.field == "response_format"
    assert p.num_outstanding == 1  # still running on its thread: the cap counts it
    with pytest.raises(QueueFull):
        await p.compile("json_schema", "other")
    cache.release.set()
    for _ in range(50):
        await asyncio.sleep(0.02)
        if not p.num_outstanding:
            break
    assert p.num_outstanding == 0
    assert await p.compile("json_schema", "slow") == ("compiled", "slow")  # cached meanwhile
    p.close()


async def test_a_compile_that_cannot_start_in_time_is_a_retry_later() -> None:
    p, cache = pool(max_concurrent=1, max_waiting=1, timeout_s=0.3)
    first = asyncio.create_task(p.compile("json_schema", "a"))
    await asyncio.sleep(0.05)
    with pytest.raises(QueueFull, match="did not start within 0.3 s"):
        await p.compile("json_schema", "b")
    cache.release.set()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0.1)
    assert cache.calls == ["a"]  # b was dropped before it started
    p.close()


async def test_a_queued_compile_whose_client_went_never_runs() -> None:
    p, cache = pool(max_concurrent=1, max_waiting=4)
    first = asyncio.create_task(p.compile("json_schema", "a"))
    gone = asyncio.create_task(p.compile("json_schema", "b"))
    await asyncio.sleep(0.1)
    gone.cancel()  # the RPC was cancelled: its client went
    await asyncio.sleep(0.05)
    cache.release.set()
    await first
    await asyncio.sleep(0.1)
    assert cache.calls == ["a"]
    assert p.num_outstanding == 0
    p.close()


async def test_the_default_executor_never_waits_behind_compiles() -> None:
    p, cache = pool(max_concurrent=2, max_waiting=2)
    busy = [asyncio.create_task(p.compile("json_schema", s)) for s in "abcd"]
    await asyncio.sleep(0.05)
    # what the KV-store fetch runs on (asyncio.to_thread): answered at once
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 1.0) == 42
    cache.release.set()
    await asyncio.gather(*busy)
    p.close()
