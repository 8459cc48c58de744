"""Tensor parallelism through the engine: two ranks over gloo (two processes) give the greedy
tokens and the logits of one rank, for tiny random Llama and Qwen3 checkpoints; the KV blocks they
export are the one-rank bytes; a checkpoint that cannot be split is refused before any rank
starts."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scoring import final_logits
from tests.engine.conftest import build_tiny_model

PROMPT_LENGTHS = [1, 19, 70]  # one token, a partial block, more than one 32-token chunk
NEW_TOKENS = 12


def _config(folder, tp: int, **kw) -> EngineConfig:
    base = dict(model=str(folder), device="cpu", dtype="float32", max_context=160,
                chunk_tokens=32, max_batch=3, block_size=16, attn_tile_tokens=32,
                tensor_parallel_size=tp)
    base.update(kw)
    return EngineConfig(**base)


def greedy_and_logits(engine: LLMEngine, prompts: dict[str, list[int]],
                      new_tokens: int = NEW_TOKENS):
    """Each prompt's final logits (scored alone), then its greedy tokens (all run together)."""
    logits = {rid: final_logits(engine, p, request_id=f"score-{rid}") for rid, p in prompts.items()}
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    return tokens, logits


@pytest.fixture(scope="module", params=[
    ("llama", {}, 2),  # 4 heads, 2 KV heads: both split over 2 ranks
    ("qwen3", {}, 2),  # head_dim 24 != hidden / heads, per-head q/k norms
    ("qwen3", {"num_key_value_heads": 1}, 2),  # one KV head: replicated on both ranks
    ("qwen2", {}, 2),  # q/k/v biases split with their heads
    ("llama", {"attention_bias": True}, 2),  # o_proj's bias added once, by rank 0
    ("llama", {}, 4),  # 2 KV heads over 4 ranks: each held by two; 88 / 4 = 22 of the MLP
], ids=["llama", "qwen3", "qwen3-kv1", "qwen2", "llama-bias", "llama-tp4"])
def checkpoint(request, tmp_path_factory):
    family, overrides, size = request.param
    folder = tmp_path_factory.mktemp(family)
    build_tiny_model(family, seed=3, **overrides).save_pretrained(folder)
    return folder, size


def test_ranks_match_one_rank(checkpoint):
    checkpoint, size = checkpoint
    g = torch.Generator().manual_seed(0)
    prompts = {f"len{n}": torch.randint(3, 131, (n,), generator=g).tolist()
               for n in PROMPT_LENGTHS}
    one = LLMEngine.from_config(_config(checkpoint, 1))
    ref_tokens, ref_logits = greedy_and_logits(one, prompts)
    one_kv = one.kv_layout
    two = LLMEngine.from_config(_config(checkpoint, size))
    try:
        assert two.ranks is not None and len(two.ranks.pids) == size - 1
        assert all(p.is_alive() for p in two.ranks.procs)
        # each rank plans for its own share: fewer weight bytes, same number of KV blocks
        assert two.plan.term("weights") < one.plan.term("weights")
        assert two.plan.num_blocks == one.plan.num_blocks
        assert two.plan.term("tp.allreduce_staging") > 0
        tokens, logits = greedy_and_logits(two, prompts)
        assert tokens == ref_tokens
        for rid in prompts:
            torch.testing.assert_close(logits[rid], ref_logits[rid], rtol=1e-4, atol=1e-4)
        # the store sees the one-rank layout: same geometry and fingerprint, same bytes
        assert two.kv_layout.fingerprint == one_kv.fingerprint
        assert two.kv_layout.bytes_per_block == one_kv.bytes_per_block
        _check_kv_round_trip(one, two, prompts["len70"])
    finally:
        two.close()
    assert all(not p.is_alive() for p in two.ranks.procs)


def export_kept(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Prefill ``prompt`` keeping its KV ("keep"; the caller releases it): its full blocks and
    their exported bytes."""
    engine.add_request("keep", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                       keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    block_ids, num_tokens = engine.kept_kv("keep")
    full = block_ids[: num_tokens // engine.config.block_size]
    return full, engine.kv_layout.export_blocks(engine.kv_cache, full)


def _check_kv_round_trip(one: LLMEngine, two: LLMEngine, prompt: list[int]) -> None:
    """Blocks a two-rank engine exports equal the one-rank engine's for the same prompt, and
    importing them back into other blocks restores them on every rank."""
    (_, ref), (ids, got) = export_kept(one, prompt), export_kept(two, prompt)
    assert got.shape == ref.shape
    torch.testing.assert_close(got.view(torch.float32), ref.view(torch.float32), rtol=1e-4,
                               atol=1e-4)
    # write them into other blocks and read those back: the round trip covers every rank
    spare = [b for b in range(1, two.plan.num_blocks) if b not in ids][: len(ids)]
    two.kv_layout.import_blocks(two.kv_cache, spare, got)
    torch.testing.assert_close(two.kv_layout.export_blocks(two.kv_cache, spare), got)
    for engine in (one, two):
        engine.release("keep")


def test_unsplittable_model_is_refused_before_ranks_start(tmp_path):
    build_tiny_model("llama", intermediate_size=87).save_pretrained(tmp_path)
    with pytest.raises(PlanError, match="intermediate_size=87"):
        LLMEngine.from_config(_config(tmp_path, 2))
    with pytest.raises(PlanError, match="tensor_parallel_size must be >= 1"):
        _config(tmp_path, 0)
