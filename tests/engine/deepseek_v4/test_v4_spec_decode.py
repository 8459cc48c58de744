"""Speculative decoding on a tiny random DeepSeek-V4 (engine/models/deepseek_v4/verify_snapshots.py):
greedy tokens with n-gram drafts equal greedy tokens without them, drafts are accepted and
rejected along the way (rejections roll back the window ring, the compressors' open windows and
overlap carry, and the indexer's), and a rolled-back slot holds exactly the state of a slot that
never ran the drafts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.kv_pool import block_multiple
from engine.sampling_params import SamplingParams
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS



def _engine(model: torch.nn.Module, method: str, k: int = 3) -> LLMEngine:
    mc = ModelConfig.from_hf_dict(model.config.to_dict(), name="v4")
    bs = block_multiple(DeepseekV4Config.from_hf_dict(mc.hf_config))  # many block ends
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=3, max_context=160,
                      chunk_tokens=32, block_size=bs, attn_tile_tokens=bs,
                      speculative_method=method, num_speculative_tokens=k)
    return LLMEngine(ec, mc, {n: t.clone() for n, t in model.state_dict().items()})


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    tail = torch.randint(2, 97, (9,), generator=g).tolist()
    # a repeated phrase (what n-gram drafts feed on), one random prompt, one short one
    return [[7, 8, 9, 10, 11, 12] * 6 + tail, torch.randint(2, 97, (29,), generator=g).tolist(),
            [5, 6, 5, 6, 5, 6, 5]]


def _run(engine: LLMEngine, prompts: list[list[int]], new: int) -> tuple[dict[str, list[int]], int]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=new, temperature=0.0,
                                                      ignore_eos=True))
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, steps


@pytest.mark.parametrize("name", SHORT_CONFIGS)
def test_ngram_greedy_identical_with_rollback(v4_builder: Callable[..., Any], name: str) -> None:
    model, _ = v4_builder(name)
    prompts, new = _prompts(), 70
    want, plain_steps = _run(_engine(model, "none"), prompts, new)
    spec = _engine(model, "ngram")
    assert "verify_snapshots" in {t.name for t in spec.plan.terms}
    got, _ = _run(spec, prompts, new)
    assert got == want
    st = spec.stats()
    # drafts were verified, some kept and some rejected (each rejection a rollback)
    assert st.spec_num_accepted_tokens > 0, st
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens, st
