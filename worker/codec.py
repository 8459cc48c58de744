"""The one place where bulkhead.v1 messages become engine dataclasses and back, and where engine
errors become gRPC status codes.

Both workers use it; nothing else in the workers reads proto fields by hand. It never touches
tensors or the engine's state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from engine.errors import (
    ContextLengthExceeded,
    DuplicateRequest,
    EngineError,
    InvalidRequest,
    PlanError,
    QueueFull,
    StepFailed,
)
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from proto import bulkhead_pb2 as pb
from worker.engine_loop import EngineLoopFailed
from worker.errors import (
    DeadlinePassed,
    KVStoreUnavailable,
    NoTokenSampled,
    RequestAborted,
    WorkerError,
    WrongRole,
)

R = TypeVar("R")
# What a servicer may raise on purpose; anything else is a bug and reaches grpc as INTERNAL.
EXPECTED_ERRORS = (EngineError, EngineLoopFailed, WorkerError)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """proto -> engine SamplingParams; raises engine.errors.InvalidRequest naming the field.

    proto3 cannot tell "unset" from 0: a ``top_p`` of 0 means unset (off), as the proto says
    1 = off and 0 is outside (0, 1]. ``max_tokens`` of 0 is refused unless ``prompt_logprobs``
    is set (then the prompt is only scored)."""
    return SamplingParams(
        max_tokens=int(msg.max_tokens),
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty != 0 else 1.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),
        min_p=float(msg.min_p),
        min_tokens=int(msg.min_tokens),
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=(int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs")
                         else None),
        num_speculative_tokens=(int(msg.num_speculative_tokens)
                                if msg.HasField("num_speculative_tokens") else None),
    )


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                            top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def prompt_logprobs_to_proto(items: list[TokenLogprobs | None] | None) -> list[pb.TokenLogprobs]:
    """The engine's per-prompt-token list (entry 0 is None: the first token has no logprob)
    -> the wire's, which starts at prompt token 1."""
    if not items:
        return []
    assert items[0] is None and all(lp is not None for lp in items[1:])
    return [logprobs_to_proto(lp) for lp in items[1:] if lp is not None]


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    message: str


# Most specific first: ContextLengthExceeded is an InvalidRequest, every engine error an
# EngineError. The first entry ``exc`` is an instance of gives its code.
_STATUS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode],
               ...] = (
    ((EngineLoopFailed, KVStoreUnavailable), grpc.StatusCode.UNAVAILABLE),  # try another worker
    (ContextLengthExceeded, grpc.StatusCode.OUT_OF_RANGE),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
    (PlanError, grpc.StatusCode.FAILED_PRECONDITION),
    (DeadlinePassed, grpc.StatusCode.DEADLINE_EXCEEDED),
    (RequestAborted, grpc.StatusCode.ABORTED),
    (WrongRole, grpc.StatusCode.UNIMPLEMENTED),
    (NoTokenSampled, grpc.StatusCode.INTERNAL),
    (StepFailed, grpc.StatusCode.INTERNAL),  # a fault this request reaches: not retried elsewhere
)


def status_of(exc: BaseException) -> Status:
    """The single mapping of engine and worker errors to gRPC status codes."""
    for kinds, code in _STATUS:
        if isinstance(exc, kinds):
            if isinstance(exc, InvalidRequest) and code == grpc.StatusCode.INVALID_ARGUMENT:
                field = f" (field {exc.field})" if exc.field else ""
                return Status(code, f"{exc}{field}")
            return Status(code, str(exc))
    return Status(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with ``exc``'s status (raises grpc's abort exception)."""
    status = status_of(exc)
    await context.abort(status.code, status.message)


def unary_rpc(method: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Wrap a unary servicer method: what it raises of ``EXPECTED_ERRORS`` ends the call with
    ``status_of``'s code."""

    @functools.wraps(method)
    async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except EXPECTED_ERRORS as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable: abort raises") from exc

    return wrapped


def stream_rpc(method: Callable[..., AsyncIterator[R]]) -> Callable[..., AsyncIterator[R]]:
    """``unary_rpc`` for a server-streaming method (an async generator)."""

    @functools.wraps(method)
    async def wrapped(self: Any, request: Any,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[R]:
        # aclosing: a cancelled or closed stream runs the method's own clean-up (its
        # ``finally``) now, not whenever the abandoned generator is collected.
        async with contextlib.aclosing(method(self, request, context)) as items:
            try:
                async for item in items:
                    yield item
            except EXPECTED_ERRORS as exc:
                await abort_with(context, exc)

    return wrapped


def usage_to_proto(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                   num_imported_tokens: int, queue_time_s: float = 0.0,
                   prefill_time_s: float = 0.0) -> pb.Usage:
    """Usage of a finished request. ``recomputed`` = prompt tokens this worker computed."""
    return pb.Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        cached_tokens=num_cached_tokens,
        loaded_kv_tokens=num_imported_tokens,
        recomputed_tokens=max(num_prompt_tokens - num_cached_tokens, 0),
        queue_time_s=queue_time_s, prefill_time_s=prefill_time_s,
    )
