"""DeepSeek-V4 served through the engine with its KV in blocks of one pool (scheduler, chunked
prefill, batched decode, prefix sharing, planner) against transformers' generate: tiny random
configs from tests/engine/deepseek_v4."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import ContextLengthExceeded, PlanError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scoring import final_logits
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS, build_hf_v4

NEW = 10
# (config, block size): blocks of one and of several compression windows of the largest rate
CASES = [(SHORT_CONFIGS[0], 16), (SHORT_CONFIGS[1], 16), (SHORT_CONFIGS[2], 24)]


def _engine(model, block_size: int, **kw) -> LLMEngine:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_context=kw.pop("ctx", 160),
                      chunk_tokens=kw.pop("chunk", 23), max_batch=kw.pop("batch", 3),
                      block_size=block_size, attn_tile_tokens=block_size * 4, **kw)
    return LLMEngine(ec, cfg, dict(model.state_dict()))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int = NEW):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            cached[o.request_id] = o.num_cached_tokens
    return got, cached


def _reference(model, prompt: list[int], n: int = NEW) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _reference_uncached(model, prompt: list[int], n: int = NEW) -> list[int]:
    """Greedy tokens from transformers' full forward over the whole sequence at every step (no
    cache). transformers' generate (with its cache) drifts from this for some V4 prompts of the
    tiny configs (e.g. seed 0, 60 tokens, from the 5th token on), so the tests added for the
    window snapshots compare against this instead."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(out[-1])
    return out


@pytest.mark.parametrize(("name", "block_size"), CASES)
def test_pool_batched_greedy_matches_transformers(name: str, block_size: int) -> None:
    """Prompts straddling block (16/24), chunk (23) and compression (4/8/12/16) boundaries,
    batched with different lengths: each equals transformers alone."""
    model, _ = build_hf_v4(name)
    engine = _engine(model, block_size)
    assert engine.plan.term("kv_cache") == engine.plan.num_blocks * engine.kv_layout.bytes_per_block
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prompts = {f"p{n}": torch.randint(0, vocab, (n,), generator=g).tolist()
               for n in (1, 2 * block_size - 1, 2 * block_size + 1, 70)}
    got, _ = _run(engine, prompts)
    for rid, p in prompts.items():
        assert got[rid] == _reference(model, p), rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_usable_blocks


@pytest.mark.parametrize(("name", "block_size"), CASES[:2])
def test_prefix_sharing_reuses_blocks_with_same_tokens(name: str, block_size: int) -> None:
    """A resumed conversation (prompt + answer + more) reuses the blocks of the first turn:
    num_cached_tokens counts them, and the tokens equal transformers' on the whole prompt."""
    model, _ = build_hf_v4(name)
    engine = _engine(model, block_size)
    g = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    first = torch.randint(0, vocab, (45,), generator=g).tolist()
    got, cached = _run(engine, {"turn1": first})
    assert cached["turn1"] == 0
    second = first + got["turn1"] + torch.randint(0, vocab, (9,), generator=g).tolist()
    got2, cached2 = _run(engine, {"turn2": second})
    # every full block of the first turn's computed tokens (prompt + answer - 1) is reused
    computed = len(first) + NEW - 1
    assert cached2["turn2"] == computed // block_size * block_size > 0
    assert got2["turn2"] == _reference(model, second)
    # the same prompt again: all but the last block-aligned part comes from the cache
    got3, cached3 = _run(engine, {"again": second})
    assert cached3["again"] == (len(second) - 1) // block_size * block_size
    assert got3["again"] == got2["turn2"]


def test_pool_is_a_shared_token_budget_and_preemption_recomputes() -> None:
    """A pool smaller than max_batch x max_context: sequences take blocks as they grow, the
    pool runs dry, the latest arrival is preempted and later resumed from its cached blocks;
    every sequence still equals transformers."""
    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    blocks_per_seq = 160 // 16
    engine = _engine(model, 16, num_blocks=blocks_per_seq + 4, chunk=64)
    assert engine.plan.kv_tokens == (blocks_per_seq + 3) * 16
    g = torch.Generator().manual_seed(3)
    prompts = {f"q{i}": torch.randint(0, 97, (60 + i,), generator=g).tolist() for i in range(3)}
    got, _ = _run(engine, prompts, max_tokens=30)
    assert engine.stats().num_preemptions > 0
    for rid, p in prompts.items():
        assert got[rid] == _reference(model, p, 30), rid


def test_fp8_pool_is_planned_smaller_and_stays_close() -> None:
    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    exact = _engine(model, 16)
    fp8 = _engine(model, 16, kv_dtype="fp8")
    assert fp8.kv_layout.bytes_per_block < exact.kv_layout.bytes_per_block
    assert fp8.kv_layout.fingerprint != exact.kv_layout.fingerprint
    prompt = torch.randint(0, 97, (57,), generator=torch.Generator().manual_seed(2)).tolist()
    a = final_logits(exact, prompt)
    b = final_logits(fp8, prompt)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_block_size_must_hold_whole_compressor_windows() -> None:
    model, _ = build_hf_v4(SHORT_CONFIGS[2])  # rates 8 and 12: blocks of 24, 48, ...
    with pytest.raises(PlanError, match="block_size=16 must be a multiple of 24"):
        _engine(model, 16)


def test_prefix_hit_stops_at_the_last_block_end_with_a_window() -> None:
    """Window rows are not in the blocks: a step keeps a snapshot of the window only at the last
    block end it reaches. A 64-token chunk crosses block ends 16, 32, 48, 64 and keeps 64 only,
    so a request sharing 40 tokens (blocks 0-1 match) resumes at nothing and recomputes, and one
    sharing 70 tokens (blocks 0-3) resumes at 64; both equal transformers."""
    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    engine = _engine(model, 16, chunk=64)
    g = torch.Generator().manual_seed(8)
    first = torch.randint(0, 97, (80,), generator=g).tolist()
    _, cached = _run(engine, {"first": first})
    kv, table = engine.runner.kv, engine.block_manager.match_prefix(first)
    assert len(table) == 5  # blocks 0-4 of the prompt are cached by hash
    assert [kv.can_resume_after(b) for b in table] == [False, False, False, True, True]
    short = first[:40] + torch.randint(0, 97, (9,), generator=g).tolist()
    longer = first[:70] + torch.randint(0, 97, (9,), generator=g).tolist()
    for rid, prompt, want_cached in (("short", short, 0), ("longer", longer, 64)):
        got, cached = _run(engine, {rid: prompt})
        assert cached[rid] == want_cached, rid
        assert got[rid] == _reference_uncached(model, prompt), rid


def test_four_sequences_fill_the_pool_and_the_fifth_waits() -> None:
    """The must-show at small shape: 4 sequences of different lengths (prompts 30, 41, 50, 25
    + 10 new tokens; before their last step they hold 38, 49, 58, 33 tokens: 3 + 4 + 4 + 3
    blocks of 16) share a pool of exactly 14 blocks; it runs dry without a
    preemption, a fifth request (60-token prompt: 4 blocks, 3 are free when it arrives) waits
    for blocks instead of being computed, and every output equals that sequence alone. A request
    over the planned context is refused before any compute, naming the limit."""
    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    engine = _engine(model, 16, num_blocks=1 + 14, ctx=64, chunk=256, batch=5)
    assert engine.plan.kv_tokens == 14 * 16
    # the window snapshots beside the blocks are planned at exactly what is allocated
    kv = engine.runner.kv
    assert engine.plan.term("resume_windows") == sum(t.numel() * t.element_size()
                                                     for t in kv.window_tensors()) > 0
    g = torch.Generator().manual_seed(4)
    prompts = {f"s{n}": torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 41, 50, 25)}
    prompts["late"] = torch.randint(0, 97, (60,), generator=g).tolist()
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 64 tokens"):
        engine.add_request("too-long", prompts["late"], SamplingParams(max_tokens=5))
    sp = {rid: SamplingParams(max_tokens=4 if rid == "late" else NEW, temperature=0,
                              ignore_eos=True) for rid in prompts}
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp[rid])
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    min_free, late_started_after = engine.block_manager.num_free_blocks, None
    finished: set[str] = set()
    while engine.has_unfinished():
        outs = engine.step()
        min_free = min(min_free, engine.block_manager.num_free_blocks)
        for o in outs:
            if o.request_id == "late" and late_started_after is None:
                late_started_after = set(finished)
            got[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
    assert min_free == 0  # the four filled the pool
    assert engine.stats().num_preemptions == 0
    assert late_started_after == {"s30", "s41", "s50", "s25"}  # it waited for their blocks
    for rid, p in prompts.items():
        assert got[rid] == _reference_uncached(model, p, sp[rid].max_tokens), rid


def test_a_conversation_resumes_at_a_block_end_its_decode_reached() -> None:
    """An agent loop's next turn carries the previous answer: the block end at 32 is reached
    while decoding (one token a step, the batched decode path, which writes only the window
    rings), so its window snapshot must come out of the rings there. The next turn then resumes
    at 32, not at the prompt's own block end 16, and its logprobs equal transformers' (tokens
    alone are too coarse: a wrong window moves this tiny model's logits, not always its argmax)."""
    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    engine = _engine(model, 16, chunk=64)
    g = torch.Generator().manual_seed(11)
    first = torch.randint(0, 97, (20,), generator=g).tolist()
    got, _ = _run(engine, {"turn1": first}, max_tokens=16)
    second = first + got["turn1"] + torch.randint(0, 97, (5,), generator=g).tolist()
    engine.add_request("turn2", second, SamplingParams(max_tokens=4, temperature=0,
                                                       ignore_eos=True, logprobs=0))
    tokens, logprobs, cached = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            logprobs += [lp.logprob for lp in o.logprobs or ()]
            cached = o.num_cached_tokens
    assert cached == 32
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([second + tokens])).logits[0].double(), -1)
    want = [float(ref[len(second) - 1 + i, t]) for i, t in enumerate(tokens)]
    assert logprobs == pytest.approx(want, abs=1e-4)
