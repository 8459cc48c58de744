"""DeepSeek-V4 served through the engine (scheduler, chunked prefill, batched decode, planner)
against transformers' generate: tiny random configs from tests/engine/deepseek_v4."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS, build_hf_v4


@pytest.mark.parametrize("name", SHORT_CONFIGS[:2])
def test_engine_batched_greedy_matches_transformers(name):
    model, _ = build_hf_v4(name)
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    assert cfg.family == "deepseek_v4"
    ec = EngineConfig(model=name, device="cpu", dtype="float32", max_context=160,
                      chunk_tokens=23, max_batch=3, block_size=16)
    engine = LLMEngine(ec, cfg, dict(model.state_dict()))
    assert engine.plan.term("state.compressed_kv") > 0 and engine.plan.term("kv_cache") == 0
    g = torch.Generator().manual_seed(5)
    vocab = cfg.vocab_size
    prompts = {f"p{n}": torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 37, 70)}
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    model.generation_config.eos_token_id = None
    for rid, p in prompts.items():
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert got[rid] == ref, rid
    # a second request with the same prompt recomputes (no prefix sharing for per-slot state)
    engine.add_request("again", prompts["p70"], sp)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 0
    assert [t for o in outs for t in o.new_token_ids] == got["p70"]
