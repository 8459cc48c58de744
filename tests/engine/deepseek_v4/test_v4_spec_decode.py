"""Speculative decoding on a tiny random DeepSeek-V4 (engine/models/deepseek_v4/memory/verify_snapshots.py):
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
from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.memory.extent import block_multiple
from engine.sampling_params import SamplingParams
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS


def _engine(model: torch.nn.Module, method: str, k: int = 3, chunk: int = 32) -> LLMEngine:
    mc = ModelConfig.from_hf_dict(model.config.to_dict(), name="v4")
    bs = block_multiple(DeepseekV4Config.from_hf_dict(mc.hf_config))  # many block ends
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=3, max_context=160,
                      chunk_tokens=chunk, block_size=bs, attn_tile_tokens=bs,
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


def test_ngram_with_a_small_token_budget(v4_builder: Callable[..., Any]) -> None:
    """A step budget of 4 tokens for 3 sequences: verify chunks get fewer drafts than asked,
    and a rolled-back sequence's recompute is split over steps (its first part may be one
    token); greedy tokens still equal plain decoding's, with seeded sampling reproducible."""
    model, _ = v4_builder("s-csa-hca_yarn_hc2")
    prompts, new = _prompts(), 40
    want, _ = _run(_engine(model, "none", chunk=4), prompts, new)
    spec = _engine(model, "ngram", chunk=4)
    got, _ = _run(spec, prompts, new)
    assert got == want
    assert spec.stats().spec_num_accepted_tokens > 0
    sp = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    runs = []
    for rid in ("s1", "s2"):
        spec.add_request(rid, prompts[0], sp)
        toks: list[int] = []
        while spec.has_unfinished():
            for o in spec.step():
                toks += o.new_token_ids
        runs.append(toks)
    assert runs[0] == runs[1] and len(runs[0]) == 30


def test_rolled_back_slot_equals_a_slot_that_never_ran_the_drafts(
        v4_builder: Callable[..., Any]) -> None:
    """Slot 0 runs a prompt, then a verify chunk (its last token + 3 drafts) that crosses a CSA
    window end and a block end, then rolls back; slot 1 runs the prompt only. Their rings,
    open windows, the overlap row read next and token counts are equal, and the same next chunk
    gives the same logits in both."""
    from engine.models.deepseek_v4.family import DeepseekV4Family
    from tests.engine.deepseek_v4.conftest import step_batch

    model, _ = v4_builder("csa-hca-csa-s_hc3_topk_all")  # rates 4 and 16, window 5
    mc = ModelConfig.from_hf_dict(model.config.to_dict(), name="v4")
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=2, max_context=64,
                      block_size=16, attn_tile_tokens=16, speculative_method="ngram",
                      num_speculative_tokens=3)
    fam = DeepseekV4Family(mc, dict(model.state_dict()), ec)
    pool = DeepseekV4Family.kv_layout(mc, ec).allocate(9, torch.device("cpu"))
    tables = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}
    prompt = torch.randint(2, 97, (14,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(seqs: list[tuple[list[int], int, int]], drafts: int = 0) -> torch.Tensor:
        batch = step_batch(seqs, tables)
        batch.num_draft_tokens = [drafts] * len(seqs)
        hidden = fam.forward(batch, pool, None)
        return fam.compute_logits(hidden, torch.empty(hidden.shape[0], 97))

    run([(prompt, 0, 0)])
    run([(prompt, 0, 1)])  # alone too: the same arithmetic, bit for bit
    # positions 14..17: window 3 (12..15) closes, its overlap row lands in block 1 over the
    # row of window 2 the next window reads; the ring's rows of 9..12 are overwritten
    run([([40, 41, 42, 43], 14, 0)], drafts=3)
    assert pool.num_tokens[0] == 18
    nxt = [40, 41]  # the kept tokens: the last token and one accepted draft, recomputed
    got = run([(nxt, 14, 0)])  # binding restores the copy: slot 0 stands at 14 again
    want = run([(nxt, 14, 1)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for layer in pool.layers:
        torch.testing.assert_close(layer.ring[0], layer.ring[1], rtol=0, atol=0)
        for cp in (layer.compressor, layer.indexer):
            if cp is None:
                continue
            n = 16 % cp.rate  # the open window's rows
            torch.testing.assert_close(cp.buf_kv[0, :n], cp.buf_kv[1, :n], rtol=0, atol=0)
            if cp.ov_kv is not None:
                # window 3 closed again (by the recompute) in each slot's first block
                torch.testing.assert_close(cp.ov_kv[1], cp.ov_kv[5], rtol=0, atol=0)
    # a step continuing anywhere else is still refused
    with pytest.raises(InvalidRequest, match="continues at position 12"):
        run([([3], 12, 0)])
