"""Grammar compilation off the serving path: its own bounded thread pool, a time limit per
schema, a cap on compiles per worker, and nothing left queued once every client that asked for it
has gone.

A compile runs on one of ``max_concurrent`` threads of this pool only, at a lower CPU priority
(nice +10: on a busy host the compiles slow down, not the running streams); the KV-store fetches and
lookups (``asyncio.to_thread``, the loop's default executor) never queue behind it. Requests for
the same (kind, spec) share one compile, and its result stays in ``GrammarCache``'s LRU. Past
``max_concurrent + max_waiting`` distinct compiles outstanding, a new one is refused at once
(``QueueFull``: retry later). A compile that has not started within ``timeout_s`` is given up the
same way; one that has run for ``timeout_s`` is answered with an InvalidRequest naming the limit
(the schema is too costly). xgrammar cannot interrupt a running compile: it finishes on its
thread, still counted against the cap (so abandoned compiles cannot pile up), and its grammar is
cached for a retry. A compile still queued when its last waiter goes (the client left, or the
limit passed) is dropped before it starts.

This module never runs a compile on the event loop and never touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest, QueueFull
from worker.grammar_cache import GrammarCache, field_of

COMPILE_NICENESS = 10  # compile threads yield the CPU to the engine thread and the RPCs


def _lower_priority() -> None:
    """Lower this compile thread's CPU priority (Linux: a thread is a task with its own nice
    value, and the threads xgrammar starts from it inherit it), so a burst of compiles slows the
    compiles, not the steps and streams of the requests already running."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux: the default priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICENESS)


@dataclass(frozen=True)
class GrammarPoolConfig:
    max_concurrent: int = 2   # compile threads of one worker
    max_waiting: int = 16     # distinct compiles queued behind them
    timeout_s: float = 10.0   # longest one compile may run (and wait to start)

    def __post_init__(self) -> None:
        if self.max_concurrent < 1 or self.max_waiting < 0 or self.timeout_s <= 0:
            raise ValueError(f"bad grammar pool config {self}")


@dataclass
class _Compile:
    """One outstanding compile of a (kind, spec), shared by every request that waits on it."""

    future: Future[Any] = field(default_factory=Future)  # replaced by the pool's, at submit
    started: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = 0.0
    num_waiting: int = 0


class GrammarPool:
    def __init__(self, cache: GrammarCache, config: GrammarPoolConfig = GrammarPoolConfig()
                 ) -> None:
        self.cache = cache
        self.config = config
        self._executor = ThreadPoolExecutor(config.max_concurrent,
                                            thread_name_prefix="grammar-compile",
                                            initializer=_lower_priority)
        self._outstanding: dict[tuple[str, str], _Compile] = {}  # touched on the loop only

    @property
    def num_outstanding(self) -> int:
        """Compiles running or queued (abandoned ones included until they end)."""
        return len(self._outstanding)

    async def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of (kind, spec), built on this pool; see the module docstring
        for the errors. Cancelling the caller (its client went) drops a compile nobody else
        waits for, if it has not started."""
        self.cache.check(kind, spec)  # a bad kind or an oversized spec: refused at once
        hit = self.cache.cached(kind, spec)
        if hit is not None:
            return hit
        key = (kind, spec)
        job = self._outstanding.get(key)
        if job is None:
            limit = self.config.max_concurrent + self.config.max_waiting
            if len(self._outstanding) >= limit:
                raise QueueFull(f"{limit} grammar compiles are already running or queued on this "
                                "worker; retry later")
            job = self._start(key)
        job.num_waiting += 1
        try:
            return await self._wait(job, kind)
        finally:
            job.num_waiting -= 1
            if job.num_waiting == 0 and not job.started.is_set():
                job.future.cancel()  # nobody waits for it any more: it never starts

    def _start(self, key: tuple[str, str]) -> _Compile:
        loop = asyncio.get_running_loop()
        job = _Compile()

        def run() -> Any:
            job.started_at = time.monotonic()
            loop.call_soon_threadsafe(job.started.set)
            return self.cache.compile(*key)

        def ended(_: Future[Any]) -> None:  # on any thread; the dict is the loop's
            # a closed loop (RuntimeError): the worker is gone, and the dict with it
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._outstanding.pop, key, None)

        job.future = self._executor.submit(run)
        job.future.add_done_callback(ended)
        self._outstanding[key] = job
        return job

    async def _wait(self, job: _Compile, kind: str) -> Any:
        limit = self.config.timeout_s
        result = asyncio.wrap_future(job.future)
        waiting = asyncio.ensure_future(job.started.wait())
        try:
            # wait to start, or to end (a cancelled job ends without starting)
            await asyncio.wait({waiting, result}, timeout=limit,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if not job.started.is_set() and not job.future.done():
            raise QueueFull(f"the grammar compile did not start within {limit:g} s (every "
                            "compile thread of this worker is busy); retry later")
        left = limit - (time.monotonic() - job.started_at) if job.started_at else limit
        try:
            return await asyncio.wait_for(asyncio.shield(result), max(left, 0.0))
        except TimeoutError:
            raise InvalidRequest(
                f"{field_of(kind)}: building its grammar took longer than the limit of "
                f"{limit:g} s (grammar_compile_timeout_s); simplify the schema (fewer optional "
                "properties, less nesting)", field_of(kind)) from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
