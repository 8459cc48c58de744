"""Prompt logprobs through the engine's chunked path against transformers' log-softmax of one full
forward: awkward prompt lengths across chunk boundaries, more rows than one LM-head pass, a
prefix already in the cache (it must not skip the scoring), max_tokens 0, the pieces with a
batch of others, and the plan term covering the workspace it takes."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.prompt_logprobs import prompt_logprobs_workspace_bytes
from engine.sampling_params import SamplingParams
from tests.engine.conftest import build_tiny_model, saved_tiny_model
from tests.engine.test_engine_vs_transformers import make_engine


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory, "qwen2", "qwen2-plp", seed=3)


@pytest.fixture(scope="module")
def engine(qwen2):
    # chunk 13 and max_batch 3: a prompt spans chunks, a chunk several LM-head passes of 3 rows
    return make_engine(qwen2[1], max_context=256, chunk_tokens=13, max_batch=3)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row j is the distribution that scores prompt token j + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine, reqs: dict[str, list[int]], sp: SamplingParams) -> dict[str, list]:
    """request id -> [prompt_logprobs, tokens, finish_reason, token logprobs] once all are
    done."""
    for rid, p in reqs.items():
        engine.add_request(rid, p, sp)
    out: dict[str, list] = {rid: [None, [], None, None] for rid in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert out[o.request_id][0] is None, "prompt logprobs handed out twice"
                out[o.request_id][0] = o.prompt_logprobs
            out[o.request_id][1] += o.new_token_ids
            if o.logprobs:
                out[o.request_id][3] = (out[o.request_id][3] or []) + o.logprobs
            if o.finished:
                out[o.request_id][2] = o.finish_reason
    return out


def check(model, prompt: list[int], got: list, k: int) -> None:
    ref = hf_prompt_logprobs(model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for j, item in enumerate(got[1:]):
        assert item.token_id == prompt[j + 1]
        assert abs(item.logprob - float(ref[j, prompt[j + 1]])) < 1e-4, j
        top_v, top_i = torch.topk(ref[j], k)
        assert [t for t, _ in item.top] == top_i.tolist(), j
        assert torch.allclose(torch.tensor([v for _, v in item.top]), top_v, atol=1e-4)


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 130, (n,), generator=g).tolist()


@pytest.mark.parametrize("n,k", [(2, 0), (13, 5), (14, 1), (41, 3)])
def test_prompt_logprobs_equal_transformers(qwen2, engine, n: int, k: int) -> None:
    prompt = prompt_of(n, n)
    out = run(engine, {f"p{n}": prompt}, SamplingParams(max_tokens=2, temperature=0.0,
                                                        prompt_logprobs=k, ignore_eos=True))
    got, tokens, reason, _ = out[f"p{n}"]
    check(qwen2[0], prompt, got, k)
    assert len(tokens) == 2 and reason == "length"


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(qwen2, engine) -> None:
    prompt = prompt_of(30, 7)
    out = run(engine, {"z": prompt}, SamplingParams(max_tokens=0, temperature=0.0,
                                                    prompt_logprobs=2, logprobs=2))
    got, tokens, reason, _ = out["z"]
    check(qwen2[0], prompt, got, 2)
    assert tokens == [] and reason == "length"
    assert out["z"][3] is None, "no token, so no token logprobs"


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(max_tokens=0)
    assert e.value.field == "max_tokens"
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(prompt_logprobs=6)
    assert e.value.field == "prompt_logprobs"


def test_a_cached_prefix_is_scored_again(qwen2, engine) -> None:
    """The prompt's first blocks are in the prefix cache from a plain request: the scoring
    request computes them anyway (its cached_tokens are 0) and scores every position."""
    prompt = prompt_of(50, 11)
    run(engine, {"warm": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    cached_plain = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                cached_plain = o.num_cached_tokens
    assert cached_plain and cached_plain >= 32, "the plain request should hit the cache"
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                        prompt_logprobs=1))
    got = cached = None
    while engine.has_unfinished():
        for o in engine.step():
            got = o.prompt_logprobs if o.prompt_logprobs is not None else got
            if o.finished:
                cached = o.num_cached_tokens
    assert cached == 0
    check(qwen2[0], prompt, got, 1)


def test_batched_with_other_requests(qwen2, engine) -> None:
    """Scoring and plain requests in the same steps: each scored prompt is its own, the plain
    ones get none, and their tokens are what they are alone."""
    prompts = {"a": prompt_of(17, 1), "b": prompt_of(9, 2), "c": prompt_of(26, 3)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=3, temperature=0.0,
                                                  ignore_eos=True,
                                                  prompt_logprobs=None if rid == "b" else 4))
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    assert set(got) == {"a", "c"}
    for rid in ("a", "c"):
        check(qwen2[0], prompts[rid], got[rid], 4)


def test_the_plan_counts_the_scoring_workspace(engine) -> None:
    term = engine.plan.term("ws.prompt_logprobs")
    assert term == prompt_logprobs_workspace_bytes(engine.model_config.vocab_size, 13, 3) > 0
    # the warm-up scored a full chunk: its peak stayed inside the arena the plan sized
    assert engine.warmup_report.workspace_peak_bytes <= engine.plan.workspace_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_allocation_while_scoring_prompts_on_cuda() -> None:
    """GPU tier: scoring prompts of awkward lengths (one row to several chunks) beside plain
    requests makes no device allocation after the warm-up (strict mode raises naming the step),
    and the scores match a float32 log-softmax of the same forward on the device."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_config import ModelConfig

    model = build_tiny_model("qwen3", hidden_size=256, intermediate_size=704,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             vocab_size=4096, num_hidden_layers=4, max_position_embeddings=8192)
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    weights = {k: v.to("cuda", torch.float32) for k, v in model.state_dict().items()}
    ec = EngineConfig(model="tiny", device="cuda", dtype="float32", max_context=4096,
                      chunk_tokens=512, max_batch=16, block_size=16, attn_tile_tokens=256,
                      strict_allocations=True)
    engine = LLMEngine(ec, cfg, weights)
    g = torch.Generator().manual_seed(0)
    prompts = {}
    for i, n in enumerate([2, 17, 300, 513, 1000, 2047, 3000, 5, 77]):
        prompts[f"r{i}"] = torch.randint(0, 4096, (n,), generator=g).tolist()
        k = None if i % 3 == 2 else i % 6
        engine.add_request(f"r{i}", prompts[f"r{i}"], SamplingParams(
            max_tokens=0 if i % 4 == 0 and k is not None else 8, temperature=0.0,
            ignore_eos=True, prompt_logprobs=k))
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = o.prompt_logprobs
    assert engine.stats().device_allocs_since_warmup == 0
    model = model.to("cuda").eval()
    for rid in ("r1", "r4"):
        prompt = prompts[rid]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0, :-1]
                                    .float(), dim=-1).cpu()
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor([x.logprob for x in got[rid][1:]]), want, atol=2e-3)


def test_deepseek_v4_prompt_logprobs_equal_transformers() -> None:
    """The same scoring path on DeepSeek-V4's family (its KV pool, compressors and hyper-
    connections): a prompt across chunks (23), blocks (16) and compression windows, after a
    plain request put its prefix in the cache."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_config import ModelConfig
    from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS, build_hf_v4

    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_context=160,
                      chunk_tokens=23, max_batch=3, block_size=16, attn_tile_tokens=64)
    engine = LLMEngine(ec, cfg, dict(model.state_dict()))
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, model.config.vocab_size, (53,), generator=g).tolist()
    run(engine, {"plain": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
    out = run(engine, {"scored": prompt}, SamplingParams(max_tokens=0, temperature=0.0,
                                                         prompt_logprobs=3))
    check(model, prompt, out["scored"][0], 3)
