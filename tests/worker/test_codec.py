"""The one proto <-> engine codec and the one error -> gRPC status mapping."""

from __future__ import annotations

import grpc
import pytest

from engine import errors as eng
from engine.sampling_params import SamplingParams
from proto import bulkhead_pb2 as pb
from router.worker_codec import Sampling
from router.worker_codec import sampling_to_proto as router_sampling
from worker import errors as wrk
from worker.codec import sampling_from_proto, status_of, usage_to_proto
from worker.engine_loop import EngineLoopFailed


def test_sampling_round_trip_and_defaults() -> None:
    sp = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=2**40,
                        stop_token_ids=(4, 9), ignore_eos=True)
    sent = Sampling(max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, seed=2**40,
                    stop_token_ids=(4, 9), ignore_eos=True)
    assert sampling_from_proto(router_sampling(sent)) == sp
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
    with pytest.raises(eng.InvalidRequest) as err:
        sampling_from_proto(msg)
    assert err.value.field == field


@pytest.mark.parametrize("exc, code", [
    (eng.ContextLengthExceeded(100, 20, 64), grpc.StatusCode.OUT_OF_RANGE),
    (eng.InvalidRequest("bad", "prompt"), grpc.StatusCode.INVALID_ARGUMENT),
    (eng.QueueFull("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (eng.DuplicateRequest("dup"), grpc.StatusCode.ALREADY_EXISTS),
    (eng.PlanError("plan"), grpc.StatusCode.FAILED_PRECONDITION),
    (EngineLoopFailed("down"), grpc.StatusCode.UNAVAILABLE),
    (wrk.KVStoreUnavailable("store down"), grpc.StatusCode.UNAVAILABLE),
    (wrk.DeadlinePassed("late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (wrk.RequestAborted("aborted"), grpc.StatusCode.ABORTED),
    (wrk.WrongRole("wrong role"), grpc.StatusCode.UNIMPLEMENTED),
    (wrk.NoTokenSampled("no token"), grpc.StatusCode.INTERNAL),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_status_mapping(exc: BaseException, code: grpc.StatusCode) -> None:
    status = status_of(exc)
    assert status.code == code and str(exc) in status.message


def test_context_length_message_carries_the_limit() -> None:
    assert "64 tokens" in status_of(eng.ContextLengthExceeded(100, 20, 64)).message


def test_usage_counts_recomputed_prompt_tokens() -> None:
    u = usage_to_proto(num_prompt_tokens=45, num_output_tokens=10, num_cached_tokens=32,
                       num_imported_tokens=32)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.loaded_kv_tokens,
            u.recomputed_tokens) == (45, 10, 32, 32, 13)

