"""Serving one generation request: build the job, dispatch it, answer JSON or SSE.

`serve_generation` owns a request from admission to its last byte: TTFT / e2e / outcome metrics,
one log line, the in-flight slot, and the clean-up (worker calls cancelled, Aborts sent) on every
way out, including a client that disconnects.  It must never import torch and never hold state
outside the `RouterContext` it is given.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.admission import Admission
from router.background import BackgroundTasks
from router.choice_runner import ChoiceDelta
from router.crash_blame import WorkerCrashed
from router.dispatch import Dispatch, Dispatcher
from router.errors import ApiError, WorkerCallError, from_worker_error
from router.job import GenerationJob
from router.metrics import RouterMetrics
from router.openai_format import ChunkWriter, full_response, sse
from router.quarantine import QuarantinedRequest
from router.registry import WorkerRegistry
from router.settings import RouterSettings
from router.sse import ClientGone, EventStreamResponse, run_until_disconnect
from router.tokenizer_port import RouterTokenizer

log = logging.getLogger("bulkhead.router")


@dataclass(frozen=True)
class RouterContext:
    """Everything a request handler needs; built in the lifespan, stored on app.state."""

    settings: RouterSettings
    tokenizer: RouterTokenizer
    registry: WorkerRegistry
    metrics: RouterMetrics
    background: BackgroundTasks
    dispatcher: Dispatcher
    admission: Admission
    # bounds the prompts tokenized at once (each in a thread, without the GIL)
    tokenize_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))


class AsciiJSONResponse(JSONResponse):
    """JSON escaped to ASCII: a message quoting client text (a lone surrogate, say) always
    encodes, where Starlette's UTF-8 rendering would raise while answering the error."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False,
                          separators=(",", ":")).encode("ascii")


KEEPALIVE = ": keep-alive\n\n"


async def _ready_within(task: asyncio.Future[ChoiceDelta], timeout_s: float) -> bool:
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return bool(done)


def error_response(err: ApiError) -> JSONResponse:
    return AsciiJSONResponse(err.body(), status_code=err.status, headers=err.headers())


# the fields a worker names when a grammar does not compile (worker/grammar_cache.py)
_GRAMMAR_FIELDS = ("response_format", "structured_outputs", "tools")


def named_for_request(err: ApiError, job: GenerationJob | None) -> ApiError:
    """A worker's grammar error names the field this request used (``guided_json``,
    ``structured_outputs.regex``, ...) rather than the grammar kind's usual field."""
    if (job is None or not job.grammar_param or err.code != "invalid_argument"
            or err.param not in _GRAMMAR_FIELDS or err.param == job.grammar_param):
        return err
    message = err.message.replace(f"{err.param}:", f"{job.grammar_param}:", 1)
    return replace(err, message=message, param=job.grammar_param)


def as_api_error(exc: BaseException, ctx: RouterContext) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, WorkerCallError):
        return from_worker_error(exc, ctx.settings.retry_after_s)
    if isinstance(exc, QuarantinedRequest):
        return ApiError(500, str(exc), "server_error", None, "request_quarantined")
    if isinstance(exc, WorkerCrashed):
        return ApiError(503, str(exc), "service_unavailable", None, "worker_crashed",
                        ctx.settings.retry_after_s)
    log.error("internal error: %r", exc, exc_info=exc)
    return ApiError(500, f"Internal error: {type(exc).__name__}", "server_error", None,
                    "internal_error")


class _Outcome:
    """Observes one request once: TTFT at the first token, e2e and a log line at the end."""

    def __init__(self, metrics: RouterMetrics, admission: Admission) -> None:
        admission.acquire()   # raises 429 when the router is full
        self._admission = admission
        self._metrics = metrics
        self._started = time.monotonic()
        self._ttft_s: float | None = None
        self._done = False
        self.dispatch: Dispatch | None = None
        metrics.in_flight.inc()

    def saw(self, d: ChoiceDelta, route: str) -> None:
        if d.token_ids and self._ttft_s is None:
            self._ttft_s = time.monotonic() - self._started
            self._metrics.ttft.labels(route).observe(self._ttft_s)

    def finish(self, outcome: str) -> None:
        if self._done:
            return
        self._done = True
        self._admission.release()
        e2e_s = time.monotonic() - self._started
        self._metrics.in_flight.dec()
        self._metrics.requests.labels(outcome).inc()
        self._metrics.e2e.labels(outcome).observe(e2e_s)
        d = self.dispatch
        if d is not None:   # one line per request that reached a worker (no request content)
            log.info("%s outcome=%s routes=%s prompt_tokens=%d output_tokens=%d ttft_s=%s "
                     "e2e_s=%.3f", d.request_id, outcome,
                     ",".join(sorted({r.spec.route.kind for r in d.runners})),
                     sum(len(r.spec.prompt_token_ids) for r in d.runners),
                     sum(len(r.stats.token_ids) for r in d.runners),
                     "-" if self._ttft_s is None else f"{self._ttft_s:.3f}", e2e_s)


def _account(dispatch: Dispatch, metrics: RouterMetrics) -> None:
    for r in dispatch.runners:
        metrics.prompt_tokens_seen.inc(len(r.spec.prompt_token_ids))
        if r.stats.finish_reason:
            metrics.finished.labels(r.stats.finish_reason).inc()
        metrics.kv_tokens.labels("loaded").inc(r.stats.num_loaded_tokens)
        metrics.kv_tokens.labels("cached").inc(r.stats.num_cached_tokens)
        metrics.kv_tokens.labels("recomputed").inc(r.stats.num_recomputed_tokens)
        if r.stats.finish_reason:   # vLLM's per-request series: one observation per choice
            metrics.request_prompt_tokens.observe(len(r.spec.prompt_token_ids))
            metrics.request_generation_tokens.observe(len(r.stats.token_ids))
            metrics.request_time.labels("queue").observe(r.stats.queue_time_s)
            metrics.request_time.labels("prefill").observe(r.stats.prefill_time_s)
            metrics.request_time.labels("decode").observe(r.stats.decode_time_s)


async def _stream_body(ctx: RouterContext, job: GenerationJob, dispatch: Dispatch,
                       first: asyncio.Future[ChoiceDelta], events: AsyncIterator[ChoiceDelta],
                       outcome: _Outcome) -> AsyncIterator[str]:
    writer = ChunkWriter(job, dispatch.request_id, int(time.time()))
    route = dispatch.runners[0].spec.route.kind
    seen: set[int] = set()
    result = "cancelled"
    try:
        while not first.done():
            # a long prefill sends nothing for minutes: SSE comments keep proxies from cutting
            # the idle connection, and tell the client the request is alive
            yield KEEPALIVE
            await asyncio.wait({first}, timeout=ctx.settings.sse_keepalive_s)
        delta: ChoiceDelta | None = first.result()
        for line in writer.opening():
            yield line
        while delta is not None:
            outcome.saw(delta, route)
            chunk = writer.delta(delta, delta.index not in seen)
            seen.add(delta.index)
            if chunk is not None:
                yield chunk
            delta = await anext(events, None)
        if job.include_usage:
            yield writer.usage_chunk(dispatch.runners)
        result = "ok"
        yield sse("[DONE]")
    except Exception as exc:   # noqa: BLE001 - whatever cut the stream, the client gets a word
        # (a worker that died, a bug): an OpenAI error event and [DONE], never a bare reset
        err = named_for_request(as_api_error(exc, ctx), job)
        result = err.code or str(err.status)
        yield sse(err.body())
        yield sse("[DONE]")
    finally:
        await _settle(first)
        await events.aclose()
        dispatch.close()
        _account(dispatch, ctx.metrics)
        outcome.finish(result)


async def _settle(task: asyncio.Future[ChoiceDelta]) -> None:
    """Cancel a pending first-delta read and wait for it, so the generator it reads from is
    not running when it is closed."""
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _build_job(ctx: RouterContext, build: Callable[[int], GenerationJob]) -> GenerationJob:
    """Validate and tokenize off the event loop, a bounded number at once.

    The context limit is read first, so a prompt whose length alone proves it too long is
    refused before it is tokenized (router/job.py)."""
    max_context = ctx.dispatcher.context_limit()
    async with ctx.tokenize_slots:
        started = time.monotonic()
        job = await asyncio.to_thread(build, max_context)
        ctx.metrics.phase.labels("tokenize").observe(time.monotonic() - started)
    return job


async def serve_generation(ctx: RouterContext, request: Request,
                 build: Callable[[int], GenerationJob]) -> Response:
    try:
        outcome = _Outcome(ctx.metrics, ctx.admission)
    except ApiError as err:
        ctx.metrics.requests.labels(err.code or str(err.status)).inc()
        return error_response(err)
    handed_over = False
    result = "error"
    job: GenerationJob | None = None
    try:
        job = await _build_job(ctx, build)
        dispatch = await ctx.dispatcher.start(job)
        outcome.dispatch = dispatch
        events = dispatch.deltas()
        first: asyncio.Future[ChoiceDelta] | None = None
        try:
            if job.stream:
                first = asyncio.ensure_future(anext(events))
                if await run_until_disconnect(_ready_within(first, ctx.settings.sse_keepalive_s),
                                              request.receive):
                    first.result()   # failed before any byte went out: an HTTP error status
                # else: a slow first token; the stream opens now and keeps itself alive
                handed_over = True
                return EventStreamResponse(
                    _stream_body(ctx, job, dispatch, first, events, outcome),
                    headers={"x-request-id": dispatch.request_id})
            route = dispatch.runners[0].spec.route.kind

            async def collect() -> None:
                async for d in events:
                    outcome.saw(d, route)

            await run_until_disconnect(collect(), request.receive)
            _account(dispatch, ctx.metrics)
            result = "ok"
            return JSONResponse(full_response(job, dispatch.request_id, int(time.time()),
                                              dispatch.runners),
                                headers={"x-request-id": dispatch.request_id})
        finally:
            if not handed_over:
                if first is not None:
                    await _settle(first)
                await events.aclose()
                dispatch.close()   # also when the generator never started
    except ClientGone:
        result = "cancelled"
        return Response(status_code=499)
    except (ApiError, WorkerCallError, QuarantinedRequest, WorkerCrashed) as exc:
        err = named_for_request(as_api_error(exc, ctx), job)
        result = err.code or str(err.status)
        return error_response(err)
    finally:
        if not handed_over:
            outcome.finish(result)
