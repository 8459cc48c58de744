"""The one proto <-> engine codec and the one error -> gRPC status mapping."""

from __future__ import annotations

import grpc
import pytest

from engine.errors import (
    ContextLengthExceeded,
    DuplicateRequest,
    InvalidRequest,
    PlanError,
    QueueFull,
)
from engine.sampling_params import SamplingParams
from proto import bulkhead_pb2 as pb
from worker.codec import sampling_from_proto, sampling_to_proto, status_of, usage_to_proto
from worker.engine_loop import EngineLoopFailed


def test_sampling_round_trip_and_defaults() -> None:
    sp = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=2**40,
                        stop_token_ids=(4, 9), ignore_eos=True)
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    unset = sampling_from_proto(pb.SamplingParams(max_tokens=2))
    assert (unset.temperature, unset.top_p, unset.top_k, unset.seed) == (0.0, 1.0, 0, None)
    assert sampling_from_proto(pb.SamplingParams(max_tokens=2, seed=0)).seed == 0


@pytest.mark.parametrize("msg, field", [
    (pb.SamplingParams(), "max_tokens"),
    (pb.SamplingParams(max_tokens=1, temperature=-1), "temperature"),
    (pb.SamplingParams(max_tokens=1, top_p=1.5), "top_p"),
    (pb.SamplingParams(max_tokens=1, top_k=-2), "top_k"),
])
def test_out_of_range_sampling_names_the_field(msg: pb.SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        sampling_from_proto(msg)
    assert err.value.field == field


@pytest.mark.parametrize("exc, code", [
    (ContextLengthExceeded(100, 20, 64), grpc.StatusCode.OUT_OF_RANGE),
    (InvalidRequest("bad", "prompt"), grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DuplicateRequest("dup"), grpc.StatusCode.ALREADY_EXISTS),
    (PlanError("plan"), grpc.StatusCode.FAILED_PRECONDITION),
    (EngineLoopFailed("down"), grpc.StatusCode.UNAVAILABLE),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_status_mapping(exc: BaseException, code: grpc.StatusCode) -> None:
    status = status_of(exc)
    assert status.code == code and str(exc) in status.message


def test_context_length_message_carries_the_limit() -> None:
    assert "64 tokens" in status_of(ContextLengthExceeded(100, 20, 64)).message


def test_usage_counts_recomputed_prompt_tokens() -> None:
    u = usage_to_proto(num_prompt_tokens=45, num_output_tokens=10, num_cached_tokens=32,
                       num_imported_tokens=32)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.loaded_kv_tokens,
            u.recomputed_tokens) == (45, 10, 32, 32, 13)
