"""The one place where bulkhead.v1 messages become engine dataclasses and back, and where engine
errors become gRPC status codes.

Both workers use it; nothing else in the workers reads proto fields by hand. It never touches
tensors or the engine's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from engine.errors import (
    ContextLengthExceeded,
    DuplicateRequest,
    EngineError,
    InvalidRequest,
    PlanError,
    QueueFull,
)
from engine.sampling_params import SamplingParams
from proto import bulkhead_pb2 as pb
from worker.engine_loop import EngineLoopFailed


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """proto -> engine SamplingParams; raises engine.errors.InvalidRequest naming the field.

    proto3 cannot tell "unset" from 0: a ``top_p`` of 0 means unset (off), as the proto says
    1 = off and 0 is outside (0, 1]. ``max_tokens`` of 0 is refused (it is required)."""
    return SamplingParams(
        max_tokens=int(msg.max_tokens),
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p > 0 else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
        ignore_eos=bool(msg.ignore_eos),
    )


def sampling_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                            top_k=sp.top_k, stop_token_ids=list(sp.stop_token_ids),
                            ignore_eos=sp.ignore_eos)
    if sp.seed is not None:
        msg.seed = sp.seed
    return msg


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    message: str


def status_of(exc: BaseException) -> Status:
    """The single mapping of engine/worker errors to gRPC status codes."""
    if isinstance(exc, EngineLoopFailed):  # the worker is going down: try another
        return Status(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, ContextLengthExceeded):
        return Status(grpc.StatusCode.OUT_OF_RANGE, str(exc))
    if isinstance(exc, InvalidRequest):
        field = f" (field {exc.field})" if exc.field else ""
        return Status(grpc.StatusCode.INVALID_ARGUMENT, f"{exc}{field}")
    if isinstance(exc, QueueFull):
        return Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, DuplicateRequest):
        return Status(grpc.StatusCode.ALREADY_EXISTS, str(exc))
    if isinstance(exc, PlanError):
        return Status(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, EngineError):
        return Status(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    return Status(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def usage_to_proto(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                   num_imported_tokens: int) -> pb.Usage:
    """Usage of a finished request. ``recomputed`` = prompt tokens this worker computed."""
    return pb.Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        cached_tokens=num_cached_tokens,
        loaded_kv_tokens=num_imported_tokens,
        recomputed_tokens=max(num_prompt_tokens - num_cached_tokens, 0),
    )
