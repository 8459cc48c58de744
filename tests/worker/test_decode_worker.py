"""The decode worker served in-process over real gRPC (no KV store): streaming against
transformers, continuous batching, refusals before compute, cancellation, deadlines, health."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.settings import WorkerSettings
from decode_worker.server import DecodeServicer
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.helpers.loop_thread import LoopThread
from tests.helpers.tiny_model import hf_greedy
from worker.worker_base import RunningServer, WorkerRuntime, build_runtime, start_server

MAX_CONTEXT = 300


class Worker:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        settings = WorkerSettings(role="decode", model=str(folder), device="cpu",
                                  dtype="float32", max_context=MAX_CONTEXT, chunk_tokens=48,
                                  max_batch=4, block_size=16, attn_tile_tokens=64, max_queue=4,
                                  num_threads=1)
        self.rt: WorkerRuntime = build_runtime(settings)
        self.lt = LoopThread()
        self.running: RunningServer = self.lt.run(
            start_server(self.rt, DecodeServicer, "127.0.0.1", 0))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.running.port}")
        self.stub = pb_grpc.WorkerStub(self.channel)

    def generate(self, prompt: list[int], max_tokens: int, **kw: object) -> tuple[list[int], pb.GenerateChunk]:
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling, **kw)
        tokens: list[int] = []
        last = None
        for chunk in self.stub.Generate(req, timeout=60):
            tokens += list(chunk.token_ids)
            last = chunk
        assert last is not None and last.finish_reason
        return tokens, last

    def close(self) -> None:
        self.channel.close()
        self.lt.run(self.running.stop(1.0))
        self.rt.close()
        self.lt.close()


@pytest.fixture(scope="module")
def worker(tiny_llama: Path) -> Iterator[Worker]:
    w = Worker(tiny_llama)
    yield w
    w.close()


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 300 + 4 for i in range(n)]


def test_health_and_info(worker: Worker) -> None:
    health = health_pb2_grpc.HealthStub(worker.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="bulkhead.v1.Worker")).status == \
        health_pb2.HealthCheckResponse.SERVING
    info = worker.stub.GetInfo(pb.WorkerInfoRequest(), timeout=5)
    assert info.role == "decode" and info.max_context == MAX_CONTEXT and info.max_batch == 4
    assert info.compat.dtype == "float32" and info.compat.block_size == 16
    assert len(info.compat.model_fingerprint) == 64 and len(info.compat.tokenizer_fingerprint) == 64
    assert info.compat.kv_layout_fingerprint and info.memory_planned_bytes > 0
    assert info.free_kv_tokens == worker.rt.engine.plan.kv_tokens


def test_stream_matches_transformers_with_batching(worker: Worker) -> None:
    prompts = [prompt_of(n, s) for s, n in enumerate([1, 17, 97, 130])]
    expected = [hf_greedy(worker.folder, p, 12) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: worker.generate(p, 12), prompts))
    for (tokens, last), want, p in zip(results, expected, prompts, strict=True):
        assert tokens == want
        assert last.finish_reason == ("stop" if len(want) < 12 else "length")
        assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == len(want)
        assert last.usage.loaded_kv_tokens == 0
    info = worker.stub.GetInfo(pb.WorkerInfoRequest(), timeout=5)
    assert info.steps_completed > 0 and info.num_running == 0


def test_continues_after_a_prefill_elsewhere_without_kv(worker: Worker) -> None:
    # No KV store here: the worker recomputes the prompt and continues after first_token_id,
    # without repeating it.
    prompt = prompt_of(40, 9)
    want = hf_greedy(worker.folder, prompt, 8, stop_at_eos=False)
    tokens, last = worker.generate(prompt, 8, has_prefill=True, first_token_id=want[0])
    assert [want[0], *tokens][: len(want)] == want[: len(tokens) + 1]
    assert last.usage.completion_tokens == len(tokens) + 1
    assert last.usage.recomputed_tokens == 40


@pytest.mark.parametrize("prompt_len, max_tokens, code, needle", [
    (290, 20, grpc.StatusCode.OUT_OF_RANGE, "maximum context length is 300"),
    (10, 0, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (0, 5, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
])
def test_refusals_before_compute(worker: Worker, prompt_len: int, max_tokens: int,
                                 code: grpc.StatusCode, needle: str) -> None:
    before = worker.stub.GetInfo(pb.WorkerInfoRequest(), timeout=5).tokens_advanced
    with pytest.raises(grpc.RpcError) as err:
        worker.generate(prompt_of(prompt_len, 1), max_tokens)
    assert err.value.code() == code and needle in err.value.details()
    assert worker.stub.GetInfo(pb.WorkerInfoRequest(), timeout=5).tokens_advanced == before


def test_token_outside_vocab_is_invalid(worker: Worker) -> None:
    with pytest.raises(grpc.RpcError) as err:
        worker.generate([5, 10**6], 4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "vocabulary" in err.value.details()


def test_queue_full_is_resource_exhausted(worker: Worker) -> None:
    # Hold the engine thread so requests pile up in the waiting queue (max_queue=4).
    gate = threading.Event()
    worker.rt.loop.post(lambda engine: gate.wait(10))
    try:
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(worker.generate, prompt_of(8, i), 2) for i in range(5)]
            time.sleep(0.5)
            gate.set()
            outcomes = []
            for f in futures:
                try:
                    f.result()
                    outcomes.append("ok")
                except grpc.RpcError as e:
                    outcomes.append(e.code())
    finally:
        gate.set()
    assert sorted(map(str, outcomes)) == sorted(
        map(str, ["ok"] * 4 + [grpc.StatusCode.RESOURCE_EXHAUSTED]))


def test_cancel_aborts_and_frees_blocks(worker: Worker) -> None:
    full = worker.stub.GetInfo(pb.WorkerInfoRequest(), timeout=5).free_kv_tokens
    req = pb.GenerateRequest(prompt_token_ids=prompt_of(60, 3),
                             sampling=pb.SamplingParams(max_tokens=200, temperature=0.0,
                                                        ignore_eos=True))
    call = worker.stub.Generate(req, timeout=60)
    next(call)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        info = worker.stub.GetInfo(pb.WorkerInfoRequest(), timeout=5)
        if info.num_running == 0 and info.free_kv_tokens == full:
            break
        time.sleep(0.05)
    assert info.num_running == 0 and info.free_kv_tokens == full


def test_abort_rpc_and_deadline(worker: Worker) -> None:
    assert not worker.stub.Abort(pb.AbortRequest(request_id="nope"), timeout=5).found
    with pytest.raises(grpc.RpcError) as err:
        worker.generate(prompt_of(5, 2), 3, deadline_unix_s=time.time() - 1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # A running request aborted by id ends its stream with finish_reason "abort".
    req = pb.GenerateRequest(request_id="to-abort", prompt_token_ids=prompt_of(30, 4),
                             sampling=pb.SamplingParams(max_tokens=250, temperature=0.0,
                                                        ignore_eos=True))
    call = worker.stub.Generate(req, timeout=60)
    next(call)
    assert worker.stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5).found
    last = list(call)[-1]
    assert last.finish_reason == "abort"


def test_prefill_is_not_served_here(worker: Worker) -> None:
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Prefill(pb.PrefillRequest(prompt_token_ids=[1, 2]), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
