"""Prefill worker -> LMCache/Redis -> decode worker, each its own OS process (the CLI), driven
over gRPC: the decode side loads the KV instead of recomputing it, recomputes exactly the tail the
store lacks, and the tokens equal transformers' greedy output either way."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.helpers.tiny_model import hf_greedy
from tests.helpers.worker_pair import handoff_flags, worker_pair

CHUNK = 16
WORKER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-context", "256", "--chunk-tokens", "40",
                "--max-batch", "4", "--block-size", "8", "--attn-tile-tokens", "64",
                # 2 blocks of 4 KiB a step: a handoff's import takes several steps
                "--kv-import-slice-mb", "0.008", *handoff_flags(CHUNK)]


@dataclass
class Pair:
    prefill: pb_grpc.WorkerStub
    decode: pb_grpc.WorkerStub
    redis_url: str
    folder: Path
    logs: list[Path]


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pair]:
    log_dir = tmp_path_factory.mktemp("handoff-logs")
    with worker_pair(tiny_llama, redis_url, WORKER_FLAGS, log_dir) as (prefill, decode, logs):
        yield Pair(prefill, decode, redis_url, tiny_llama, logs)


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 300 + 4 for i in range(n)]


def split_generate(pair: Pair, prompt: list[int], max_tokens: int, rid: str,
                   prefill_first: pb.PrefillResponse | None = None
                   ) -> tuple[pb.PrefillResponse, list[int], pb.Usage]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    resp = prefill_first or pair.prefill.Prefill(
        pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling), timeout=60)
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                             has_prefill=True, first_token_id=resp.first_token_id, kv=resp.kv)
    tokens = [resp.first_token_id]
    usage = None
    for chunk in pair.decode.Generate(req, timeout=60):
        tokens += list(chunk.token_ids)
        if chunk.finish_reason:
            usage = chunk.usage
    assert usage is not None
    return resp, tokens, usage


def test_decode_loads_the_prefilled_kv(pair: Pair) -> None:
    # whole blocks of 8 are stored: 2 full chunks of 16 + a partial chunk of 8; the 5 tokens of
    # the partial last block are recomputed by the decode worker
    prompt = prompt_of(45, 1)
    resp, tokens, usage = split_generate(pair, prompt, 10, "h1")
    assert tokens == hf_greedy(pair.folder, prompt, 10)
    assert resp.kv.num_tokens_stored == 40 and resp.num_computed_tokens == 45
    decode_info = pair.decode.GetInfo(pb.WorkerInfoRequest(), timeout=5)
    assert resp.kv.kv_layout_fingerprint == decode_info.compat.kv_layout_fingerprint
    assert "@" not in resp.kv.store_url
    assert usage.loaded_kv_tokens == 40 and usage.recomputed_tokens == 5
    decode_log = "".join(p.read_text() for p in pair.logs if "decode" in p.name)
    assert "40 tokens in 3 slice(s)" in decode_log, decode_log[-3000:]
    assert usage.cached_tokens == 40 and usage.completion_tokens == len(tokens)
    lookup = pair.decode.Lookup(pb.LookupRequest(prompt_token_ids=prompt), timeout=5)
    assert lookup.num_cached_tokens == 40
    # The prefill worker gave its blocks back after the reply.
    info = pair.prefill.GetInfo(pb.WorkerInfoRequest(), timeout=5)
    assert info.num_running == 0 and info.free_kv_tokens == 256 * 4


def test_missing_tail_is_recomputed(pair: Pair) -> None:
    prompt = prompt_of(45, 2)
    first = pair.prefill.Prefill(pb.PrefillRequest(
        request_id="h2", prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=10, temperature=0.0)), timeout=60)
    # Evict everything, then store only the first two chunks again (a prefill of 32 tokens):
    # the store now holds 32 of the 45 tokens, as after an LRU eviction of the last chunk.
    redis.Redis.from_url(pair.redis_url).flushall()
    pair.prefill.Prefill(pb.PrefillRequest(
        request_id="h2-head", prompt_token_ids=prompt[:32],
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0)), timeout=60)
    _, tokens, usage = split_generate(pair, prompt, 10, "h2", prefill_first=first)
    assert tokens == hf_greedy(pair.folder, prompt, 10)
    assert usage.loaded_kv_tokens == 32 and usage.recomputed_tokens == 13

    # Everything evicted between prefill and decode: the decode worker computes the prompt.
    other = prompt_of(45, 4)
    first = pair.prefill.Prefill(pb.PrefillRequest(
        request_id="h3", prompt_token_ids=other,
        sampling=pb.SamplingParams(max_tokens=10, temperature=0.0)), timeout=60)
    redis.Redis.from_url(pair.redis_url).flushall()
    _, tokens, usage = split_generate(pair, other, 10, "h3", prefill_first=first)
    assert tokens == hf_greedy(pair.folder, other, 10)
    assert usage.loaded_kv_tokens == 0 and usage.recomputed_tokens == 45


def test_prefill_refusals(pair: Pair) -> None:
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill.Prefill(pb.PrefillRequest(
            prompt_token_ids=prompt_of(256, 3),
            sampling=pb.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "256" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill.Prefill(pb.PrefillRequest(prompt_token_ids=[5, 6],
                                               sampling=pb.SamplingParams(max_tokens=0)),
                             timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill.Generate(pb.GenerateRequest(prompt_token_ids=[5]), timeout=30).next()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_prefill_whose_first_token_ends_the_request(pair: Pair) -> None:
    prompt = prompt_of(20, 5)
    first = hf_greedy(pair.folder, prompt, 1, stop_at_eos=False)[0]
    resp = pair.prefill.Prefill(pb.PrefillRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1, temperature=0.0)),
        timeout=30)
    assert (resp.first_token_id, resp.finish_reason) == (first, "length")
    assert resp.kv.num_tokens_stored == 0  # nothing to hand over
    resp = pair.prefill.Prefill(pb.PrefillRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=5, temperature=0.0,
                                                            stop_token_ids=[first])),
        timeout=30)
    assert (resp.first_token_id, resp.finish_reason) == (first, "stop")
    info = pair.prefill.GetInfo(pb.WorkerInfoRequest(), timeout=5)
    assert info.num_running == 0 and info.free_kv_tokens == 256 * 4
