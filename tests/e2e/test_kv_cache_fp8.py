"""End to end with ``--kv-cache-dtype fp8`` on both workers: router + prefill + decode processes
and a real redis-server serving the tiny Llama with its K/V stored as FP8 e4m3fn. A long prompt
takes the split route (the decode worker loads the prefill worker's FP8 blocks through
LMCache), a short one runs on the decode worker; each answer equals, token for token, the
product's own engine with kv_dtype=fp8 on the same checkpoint and the workers' settings, and stays
close to the full-precision transformers answer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.e2e.conftest import CHUNK, E2E, MAX_CONTEXT, SPLIT_THRESHOLD, deploy
from tests.e2e.test_tiny_deployment import complete_ids, token_prompt
from tests.helpers.tiny_model import hf_greedy


@pytest.fixture(scope="module")
def e2e_fp8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    yield from deploy(tmp_path_factory, "--kv-cache-dtype", "fp8")


def test_both_workers_store_fp8(e2e_fp8: E2E) -> None:
    """The workers' start-up line names the KV dtype and its bytes: a quarter of fp32's here
    (2 layers x K,V x 2 heads x 16 dims x 1 B = 128 B a token)."""
    for role in ("prefill", "decode"):
        log = (e2e_fp8.deployment.log_dir / f"{role}.log").read_text()
        assert " 128 B a token, kv_dtype fp8)" in log, log[-2000:]


def engine_greedy(e2e: E2E, prompt: list[int], n: int) -> list[int]:
    """The engine the workers run, in this process: kv_dtype=fp8 and the workers' flags."""
    from engine.checkpoint import load_checkpoint
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    ckpt = load_checkpoint(e2e.folder, dtype=torch.float32, progress=False)
    ec = EngineConfig(model=str(e2e.folder), device="cpu", dtype="float32",
                      max_context=MAX_CONTEXT, chunk_tokens=48, max_batch=8, block_size=16,
                      attn_tile_tokens=64, kv_dtype="fp8")
    engine = LLMEngine(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint)
    engine.add_request("ref", prompt, SamplingParams(max_tokens=n, temperature=0))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.parametrize("stream", [False, True])
def test_split_route_moves_fp8_kv_and_answers_as_the_engine(e2e_fp8: E2E, stream: bool) -> None:
    n = 5 * CHUNK + 7  # several LMCache chunks, the last block partial
    assert n >= SPLIT_THRESHOLD
    prompt = token_prompt(n, seed=11 if stream else 12)
    loaded_before = e2e_fp8.metric("bulkhead_prompt_tokens_total", source="loaded")
    split_before = e2e_fp8.metric("bulkhead_time_to_first_token_seconds_count", route="split")
    ids, usage = complete_ids(e2e_fp8, prompt, 12, stream)
    assert e2e_fp8.metric("bulkhead_time_to_first_token_seconds_count", route="split") == \
        split_before + 1
    # the decode worker loaded the prompt's whole blocks, FP8 bytes from the prefill worker
    assert e2e_fp8.metric("bulkhead_prompt_tokens_total", source="loaded") == \
        loaded_before + n // 16 * 16
    assert usage["prompt_tokens"] == n
    assert ids == engine_greedy(e2e_fp8, prompt, 12)
    # FP8 K/V stays near full precision: the first tokens agree with transformers' fp32
    assert common_prefix(ids, hf_greedy(e2e_fp8.folder, prompt, 12)) >= 4


def test_decode_route_answers_as_the_engine(e2e_fp8: E2E) -> None:
    prompt = token_prompt(9, seed=13)
    decode_before = e2e_fp8.metric("bulkhead_time_to_first_token_seconds_count", route="decode")
    ids, _ = complete_ids(e2e_fp8, prompt, 10, stream=False)
    assert e2e_fp8.metric("bulkhead_time_to_first_token_seconds_count", route="decode") == \
        decode_before + 1
    assert ids == engine_greedy(e2e_fp8, prompt, 10)
