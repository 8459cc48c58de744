"""The engine thread of a worker: the only thread that ever calls the engine.

It runs ``engine.step()`` while there is work and otherwise waits for commands. asyncio code talks
to it through a command queue (``call`` / ``post``: a function run on the engine thread between
two steps) and receives each request's outputs on that request's own asyncio queue
(``RequestStream``). After every step it publishes an ``EngineStats`` snapshot, so GetInfo and
health never wait behind a long prefill chunk.

A step that raises for some of its sequences ends those alone (engine/step_isolation.py: their
outputs carry ``StepFailed``). If ``engine.step()`` itself raises (a device error, a
tensor-parallel step, a run of steps that failed for every sequence), the loop stops, every
open stream and pending call fails with ``EngineLoopFailed``, and ``failed`` is set: the worker
then reports NOT_SERVING and exits.
This module never calls the engine from any thread but its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from engine.llm_engine import EngineStats, KVImport, LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.staged_kv import StagedKV

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_on_a_passing_thread(build: Callable[[], T], name: str = "engine-build") -> T:
    """Run ``build`` (loading, planning, the warm-up) on a thread that has ended when this
    returns. PyTorch keeps cuBLAS/cuBLASLt handles per host thread and hands a finished thread's
    handles to the next thread that asks; the warm-up's handles (and the GEMM workspaces keyed by
    handle and stream) then pass to the engine thread. Warmed up on a thread that stays alive
    (the main one), the engine thread would create its own at its first request: device memory
    taken outside the plan after the lock. (On the H200 each worker of the split bench grew
    64 MiB at its first request with no allocation by PyTorch's allocator; that this was the
    handles is likely, not yet confirmed on a GPU.)"""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class EngineLoopFailed(RuntimeError):
    """The engine thread stopped (a step raised, or the loop was shut down)."""


class RequestStream:
    """Outputs of one request, in order; the last one has ``finished=True``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.done = False

    def _push(self, item: RequestOutput | BaseException) -> None:  # on the asyncio loop
        self._queue.put_nowait(item)

    async def next(self, timeout_s: float | None = None) -> RequestOutput:
        """The next output; raises TimeoutError after ``timeout_s`` or the loop's failure."""
        item = await asyncio.wait_for(self._queue.get(), timeout_s)
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item


class EngineLoop:
    """Owns ``engine`` on a dedicated thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05) -> None:
        self._engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any] | None]]
        self._commands = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched on the engine thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self.stats: EngineStats = engine.stats()
        self.failure: BaseException | None = None
        self.failed: asyncio.Event | None = None

    # ------------------------------------------------------------------ asyncio side
    def start(self) -> None:
        """Start the thread; call from the asyncio loop that will consume the streams."""
        self._aio_loop = asyncio.get_running_loop()
        self.failed = asyncio.Event()
        self._thread.start()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        fut: Future[T] = Future()
        self._enqueue(fn, fut)
        return await asyncio.wrap_future(fut)

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire and forget ``fn(engine)`` on the engine thread (cleanup from finally blocks)."""
        if self.failure is None and not self._stop.is_set():
            self._commands.put((fn, None))

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        kv_import: KVImport | StagedKV | None = None,
        keep_kv: bool = False,
        first_token_id: int | None = None,
        grammar: Any = None,
    ) -> RequestStream:
        """Add a request; engine errors (ContextLengthExceeded, QueueFull, ...) raise here,
        before any compute."""
        stream = RequestStream(request_id)

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt_token_ids, sampling, kv_import=kv_import,
                               keep_kv=keep_kv, first_token_id=first_token_id, grammar=grammar)
            self._streams[request_id] = stream

        await self.call(add)
        return stream

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda _: None, None))  # wake the thread
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ engine thread
    def _enqueue(self, fn: Callable[[LLMEngine], Any], fut: Future[Any]) -> None:
        if self.failure is not None or self._stop.is_set():
            fut.set_running_or_notify_cancel()
            fut.set_exception(EngineLoopFailed("the engine loop is not running"))
            return
        self._commands.put((fn, fut))
        if self.failure is not None or self._stop.is_set():
            # The thread may have drained the queue between our check and our put.
            self._drain_commands(EngineLoopFailed("the engine loop is not running"))

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_wait_s) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            # A caller cancelled before we got here (its client went away) gets nothing run on
            # its behalf; once running, its future can no longer be cancelled under us.
            if fut is None or fut.set_running_or_notify_cancel():
                try:
                    result = fn(self._engine)
                except Exception as exc:  # an engine error belongs to the caller, not the loop
                    if fut is not None:
                        fut.set_exception(exc)
                    else:
                        log.warning("engine-thread command failed: %s", exc)
                else:
                    if fut is not None:
                        fut.set_result(result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                self.stats = self._engine.stats()  # commands add, abort and release requests
                return

    def _run(self) -> None:
        engine = self._engine
        try:
            device = getattr(getattr(engine, "config", None), "torch_device", None)
            if device is not None and device.type == "cuda" and device.index is not None:
                # The current CUDA device is per thread: make it the engine's (cuda:N), so
                # anything that launches on "the current device" lands on the right GPU.
                torch.cuda.set_device(device)
            while not self._stop.is_set():
                self._run_commands(block=not engine.has_unfinished())
                if self._stop.is_set() or not engine.has_unfinished():
                    continue
                outputs = engine.step()
                self.stats = engine.stats()
                for out in outputs:
                    self._deliver(out)
        except BaseException as exc:  # noqa: BLE001 - the loop reports every way it can die
            log.exception("engine loop failed")
            self.failure = exc
            self._fail_everything(EngineLoopFailed(f"engine loop failed: {type(exc).__name__}: "
                                                   f"{exc}"))
            assert self._aio_loop is not None and self.failed is not None
            self._aio_loop.call_soon_threadsafe(self.failed.set)
        else:
            self._fail_everything(EngineLoopFailed("the worker is shutting down"))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return  # e.g. a warm-up or scoring request nobody streams
        if out.finished:
            del self._streams[out.request_id]
        assert self._aio_loop is not None
        self._aio_loop.call_soon_threadsafe(stream._push, out)

    def _fail_everything(self, err: EngineLoopFailed) -> None:
        assert self._aio_loop is not None
        for stream in self._streams.values():
            self._aio_loop.call_soon_threadsafe(stream._push, err)
        self._streams.clear()
        self._drain_commands(err)

    def _drain_commands(self, err: EngineLoopFailed) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(err)
