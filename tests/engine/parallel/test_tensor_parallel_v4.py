"""DeepSeek-V4 at two ranks over gloo: query heads, output groups and routed experts split, the
shared KV head replicated. Greedy tokens and logits equal one rank's on a tiny random V4 (sliding,
CSA and HCA layers, hash and score routing); the KV blocks exported are one rank's bytes and an
import reaches both ranks (a prefix resumed from imported blocks decodes the same)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.deepseek_v4 import conftest as v4
from tests.engine.parallel.test_tensor_parallel_engine import export_kept, greedy_and_logits

NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, request):
    old = v4._BASE["n_routed_experts"]
    v4._BASE["n_routed_experts"] = 6  # three experts a rank
    try:
        model, _ = v4.build_hf_v4("s-csa-hca_yarn_hc2", seed=2)
    finally:
        v4._BASE["n_routed_experts"] = old
    folder = tmp_path_factory.mktemp("v4")
    model.save_pretrained(folder)
    return folder


def _engine(folder, tp: int, **kw) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=str(folder), device="cpu", dtype="float32", max_context=160, chunk_tokens=23,
        max_batch=3, block_size=16, attn_tile_tokens=64, tensor_parallel_size=tp, **kw))


def _run(engine: LLMEngine, prompts: dict[str, list[int]]):
    return greedy_and_logits(engine, prompts, NEW)


def test_two_ranks_match_one_rank(checkpoint) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = {f"p{n}": torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 31, 70)}
    one = _engine(checkpoint, 1)
    ref, ref_logits = _run(one, prompts)
    two = _engine(checkpoint, 2, enable_prefix_cache=False)  # the import below is not a hit
    try:
        attn = two.runner.model.model.model.layers[0].self_attn
        assert attn.q_b_proj.weight.shape[0] == 2 * 16  # 2 of 4 heads x head_dim 16
        assert two.runner.model.model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 3
        assert two.plan.num_blocks == one.plan.num_blocks
        assert two.plan.term("kv_cache") == one.plan.term("kv_cache")  # the KV head is whole
        got, logits = _run(two, prompts)
        assert got == ref
        for r in prompts:
            torch.testing.assert_close(logits[r], ref_logits[r], rtol=1e-4, atol=1e-4)
        _check_kv_handoff(one, two, prompts["p70"])
    finally:
        two.close()


def _check_kv_handoff(one: LLMEngine, two: LLMEngine, prompt: list[int]) -> None:
    """Blocks exported at two ranks equal one rank's; imported into fresh blocks of the two-rank
    engine (every rank), a request resumed from them decodes as from scratch."""
    rows, windows = [], []
    for engine in (one, two):
        ids, data = export_kept(engine, prompt)
        rows.append(data)
        # the window at the last block end: the resume point that travels beside the blocks
        windows.append(engine.kv_layout.export_resume_state(engine.kv_cache, ids[-1]))
        engine.release("keep")
    assert two.kv_layout.fingerprint == one.kv_layout.fingerprint
    assert windows[0] is not None and windows[1] is not None
    for got_, want in ((rows[1], rows[0]), (windows[1], windows[0])):  # fp32 values
        torch.testing.assert_close(got_.view(torch.float32), want.view(torch.float32),
                                   rtol=1e-4, atol=1e-4)
    data, window = rows[1], windows[1]

    def kv_import(kv, block_ids, num_prompt_tokens, *, num_computed_tokens=0) -> int:
        ids = list(block_ids[: data.shape[0]])
        two.kv_layout.import_blocks(kv, ids, data)
        two.kv_layout.import_resume_state(kv, ids[-1], window)  # on every rank
        return two.kv_layout.resumable_tokens(kv, ids, data.shape[0] * 16)

    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    two.add_request("resumed", prompt, sp, kv_import=kv_import)
    got: list[int] = []
    cached = 0
    while two.has_unfinished():
        for o in two.step():
            got += o.new_token_ids
            cached = o.num_imported_tokens
    one.add_request("fresh", prompt, sp)
    ref: list[int] = []
    while one.has_unfinished():
        for o in one.step():
            ref += o.new_token_ids
    assert cached == 64 and got == ref


def test_a_size_that_does_not_divide_the_experts_is_refused(tmp_path) -> None:
    model, _ = v4.build_hf_v4("s-csa-hca_yarn_hc2")  # 5 routed experts
    model.save_pretrained(tmp_path)
    with pytest.raises(PlanError, match="n_routed_experts=5"):
        _engine(tmp_path, 2)


def test_fp8_and_mxfp4_weights_split_too(tmp_path) -> None:
    """The checkpoint as shipped (FP8 projections with 128x128 block scales, MXFP4 experts):
    the ranks cut the FP8 weights with their scale grid and run their MXFP4 experts only."""
    from transformers import DeepseekV4Config as HFConfig
    from transformers import DeepseekV4ForCausalLM

    from tests.engine.deepseek_v4._quantized_ckpt import write_quantized
    from tests.engine.deepseek_v4.test_deepseek_v4_quantized import RAW

    torch.manual_seed(0)
    raw = {**RAW, "n_routed_experts": 8, "o_lora_rank": 64}  # even experts; o_a cut in a block
    model = DeepseekV4ForCausalLM(HFConfig(**raw)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "sinks" in name else 0.05))
    write_quantized(model, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{n}": torch.randint(2, 97, (n,), generator=g).tolist() for n in (5, 29)}
    ref, ref_logits = _run(_engine(tmp_path, 1), prompts)
    two = _engine(tmp_path, 2)
    try:
        experts = two.runner.model.model.model.layers[1].mlp.experts
        assert type(experts).__name__ == "Mxfp4Experts" and experts.gate_up_proj.shape[0] == 4
        got, logits = _run(two, prompts)
        assert got == ref
        for r in prompts:
            torch.testing.assert_close(logits[r], ref_logits[r], rtol=1e-4, atol=1e-4)
    finally:
        two.close()
