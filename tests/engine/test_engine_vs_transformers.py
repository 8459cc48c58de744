"""The engine against transformers, token for token: tiny random Llama (llama3 rope), Qwen2 and
Qwen3 checkpoints written with save_pretrained and read back by our loader."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.errors import ContextLengthExceeded, InvalidRequest
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scoring import final_logits
from tests.engine.conftest import build_tiny_model
from tests.engine.parallel.test_tensor_parallel_engine import export_kept

LENGTHS = [1, 17, 255, 256, 257, 1000]
NEW_TOKENS = 32


def make_engine(folder, **kw) -> LLMEngine:
    ckpt = load_checkpoint(folder, dtype=torch.float32, progress=False)
    base = dict(model=str(folder), device="cpu", dtype="float32", max_context=1100,
                chunk_tokens=100, max_batch=8, block_size=16, attn_tile_tokens=64)
    base.update(kw)
    return LLMEngine(EngineConfig(**base), ckpt.config, ckpt.state_dict, ckpt.model_fingerprint)


def run_all(engine: LLMEngine, prompts: dict[str, list[int]], sp: SamplingParams) -> dict:
    for rid, p in prompts.items():
        engine.add_request(rid, p, sp)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return out, reasons


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return ids[0, len(prompt):].tolist()


def _setup(family, tmp_path_factory):
    model = build_tiny_model(family)
    folder = tmp_path_factory.mktemp(family)
    model.save_pretrained(folder)
    return family, model, folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _setup("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _setup("qwen2", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _setup("qwen3", tmp_path_factory)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def family_setup(request):
    return request.getfixturevalue(request.param)


def test_batched_greedy_matches_transformers_and_logits(family_setup):
    family, model, folder = family_setup
    engine = make_engine(folder)
    g = torch.Generator().manual_seed(1)
    prompts = {f"len{n}": torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
               for n in LENGTHS}
    got, reasons = run_all(engine, prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                            ignore_eos=True))
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(model, p, NEW_TOKENS), f"{family} {rid}"
        assert reasons[rid] == "length"
    # final-position logits through the chunked path, tight fp32 tolerance
    for n in (257, 1000):
        p = prompts[f"len{n}"]
        ours = final_logits(engine, p, request_id=f"score{n}")
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert engine.runner.ws.capacity == engine.warmup_report.workspace_capacity_bytes
    assert engine.runner.ws.peak_bytes <= engine.runner.ws.capacity


@pytest.mark.parametrize("chunk,block,tile", [(37, 16, 32), (512, 8, 8)])
def test_other_chunk_and_block_sizes(llama, chunk, block, tile):
    family, model, folder = llama
    engine = make_engine(folder, chunk_tokens=chunk, block_size=block, attn_tile_tokens=tile)
    g = torch.Generator().manual_seed(2)
    prompts = {f"p{n}": torch.randint(3, 131, (n,), generator=g).tolist() for n in (5, 100, 333)}
    got, _ = run_all(engine, prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for rid, p in prompts.items():
        assert got[rid] == hf_greedy(model, p, 8)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_gives_the_same_tokens(qwen2, temperature):
    family, model, folder = qwen2
    # 3 sequences of up to 80 tokens, but only 12 blocks of 16: someone must be preempted.
    roomy = make_engine(folder, max_context=96, max_batch=3)
    tight = make_engine(folder, max_context=96, max_batch=3, num_blocks=13)
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{i}": torch.randint(3, 131, (40 + i,), generator=g).tolist() for i in range(3)}
    # sampled requests keep their generator state across preemption
    sp = SamplingParams(max_tokens=40, temperature=temperature, seed=7, ignore_eos=True)
    want, _ = run_all(roomy, prompts, sp)
    got, _ = run_all(tight, prompts, sp)
    assert tight.stats().num_preemptions > 0
    assert got == want


def test_prefix_cache_reuses_blocks_and_keeps_output(qwen3):
    family, model, folder = qwen3
    engine = make_engine(folder)
    p = torch.randint(3, 131, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("cold", p, sp)
    cold = []
    while engine.has_unfinished():
        cold += [t for o in engine.step() for t in o.new_token_ids]
    engine.add_request("warm", p + [7, 8, 9], sp)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 144  # 9 full blocks of 16
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(model, p + [7, 8, 9], 6)



def test_an_imported_prefix_gives_the_same_tokens_and_its_hook_goes_after_the_load(qwen3):
    """A request resumed from another engine's exported blocks decodes as from scratch, and the
    engine drops the import hook (and what it holds: a fetch's host staging) once it has run,
    not when the request ends."""
    import gc
    import weakref

    family, model, folder = qwen3
    p = torch.randint(3, 131, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    _, data = export_kept(make_engine(folder), p)  # 4 full blocks of 16

    class Staged:  # stands for the host region a real fetch hands its hook
        pass

    staged = Staged()
    alive = weakref.ref(staged)

    def hook(kv, block_ids, num_prompt_tokens, *, num_computed_tokens=0, held=staged) -> int:
        dst.kv_layout.import_blocks(kv, list(block_ids[: data.shape[0]]), data)
        return data.shape[0] * 16

    dst = make_engine(folder)
    dst.add_request("dst", p, sp, kv_import=hook)
    del staged, hook
    outs = dst.step()  # admission: the load runs before any chunk
    gc.collect()
    assert alive() is None and dst.has_unfinished()
    while dst.has_unfinished():
        outs += dst.step()
    assert outs[-1].num_imported_tokens == 64
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(model, p, 6)

def test_seeded_sampling_is_reproducible(llama):
    family, model, folder = llama
    engine = make_engine(folder)
    p = list(range(3, 40))

    def sample(seed, rid):
        sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=40, seed=seed,
                            ignore_eos=True)
        return run_all(engine, {rid: p}, sp)[0][rid]

    a, b, c = sample(11, "a"), sample(11, "b"), sample(12, "c")
    assert a == b and a != c and len(a) == 12


def test_refusals_happen_before_any_compute(llama):
    family, model, folder = llama
    engine = make_engine(folder, max_context=300)
    steps = engine.stats().steps_completed
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 300 tokens"):
        engine.add_request("long", [5] * 290, SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request("bad", [5, 10_000], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not engine.has_unfinished() and engine.stats().steps_completed == steps
    # and the engine still serves
    got, _ = run_all(engine, {"ok": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0,
                                                               ignore_eos=True))
    assert len(got["ok"]) == 3
