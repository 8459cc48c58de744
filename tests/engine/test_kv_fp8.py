"""kv_dtype=fp8 on the dense families: K/V stored as FP8 e4m3fn (kernels/kv_quant.py, scale 1).

Tolerance, against the same engine with kv_dtype=auto (fp32 model, PyTorch path, tiny random
Llama / Qwen2 / Qwen3): every logprob within ``LOGPROB_TOL`` = 0.03 nats (measured max 0.011
over 250 teacher-forced positions and 24 greedy steps of three prompts), and greedy tokens equal
until a step where auto's two best tokens are within 2 x LOGPROB_TOL of each other (a near-tie
the FP8 rounding may flip; measured margins where they flipped: 0.0005-0.021).
The plan counts the pool at one byte an element; blocks move bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.attention import AttentionShape, attention_workspace_bytes
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.llm_engine import LLMEngine
from engine.memory_planner import make_plan
from engine.model_config import ModelConfig
from engine.models.dense_family import DenseKVLayout
from engine.sampling_params import SamplingParams
from tests.engine.conftest import build_tiny_model
from tests.engine.parallel.test_tensor_parallel_engine import export_kept
from tests.engine.test_graph_pool_plan import DATA

LOGPROB_TOL = 0.03


def _engine(model: Any, kv_dtype: str, **kw: Any) -> LLMEngine:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    base = dict(model="tiny", device="cpu", dtype="float32", max_context=300, chunk_tokens=40,
                max_batch=4, block_size=16, attn_tile_tokens=32, attention_backend="torch",
                kv_dtype=kv_dtype)
    base.update(kw)
    return LLMEngine(EngineConfig(**base), cfg, dict(model.state_dict()))


def _greedy(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, list[Any]]:
    """Each request's TokenLogprobs (chosen token + top 2) over 24 greedy steps."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                  logprobs=2))
    out: dict[str, list[Any]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.logprobs
    return out


def _prompt_logprobs(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Teacher-forced logprob of every prompt token after the first (chunked prefill: later
    chunks read the K/V earlier chunks wrote)."""
    engine.add_request("score", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                       prompt_logprobs=0))
    rows = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                rows = o.prompt_logprobs
    assert rows is not None
    return torch.tensor([r.logprob for r in rows[1:]])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fp8_kv_stays_within_tolerance_of_auto(family: str) -> None:
    model = build_tiny_model(family)
    auto, fp8 = _engine(model, "auto"), _engine(model, "fp8")
    assert fp8.runner.kv.data.dtype == torch.float8_e4m3fn
    assert auto.runner.kv.data.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    prompts = {f"r{n}": torch.randint(3, 131, (n,), generator=g).tolist() for n in (5, 70, 130)}
    want, got = _greedy(auto, prompts), _greedy(fp8, prompts)
    for rid in prompts:
        for step, (a, b) in enumerate(zip(want[rid], got[rid], strict=True)):
            if a.token_id != b.token_id:
                margin = a.top[0][1] - a.top[1][1]
                assert margin < 2 * LOGPROB_TOL, (
                    f"{family} {rid}: step {step} flipped {a.token_id} -> {b.token_id} with a "
                    f"margin of {margin:.4f} nats")
                break  # the sequences differ from here on
            assert abs(a.logprob - b.logprob) < LOGPROB_TOL, (family, rid, step)
    long = torch.randint(3, 131, (250,), generator=g).tolist()
    diff = (_prompt_logprobs(auto, long) - _prompt_logprobs(fp8, long)).abs()
    assert diff.max() < LOGPROB_TOL, f"{family}: prompt logprobs differ by {diff.max():.4f}"
    assert diff.max() > 0  # the cache really was FP8


def test_an_fp8_prefix_imported_into_another_engine_decodes_as_computed() -> None:
    """Exported FP8 blocks imported into another fp8 engine (other block ids) give the tokens
    the first engine computes itself: the bytes, not a conversion, cross."""
    model = build_tiny_model("qwen3")
    p = torch.randint(3, 131, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    src = _engine(model, "fp8")
    ids, data = export_kept(src, p)
    assert data.dtype == torch.uint8 and data.shape == (4, src.kv_layout.bytes_per_block)
    src.release("keep")
    src.add_request("ref", p, sp)
    want: list[int] = []
    while src.has_unfinished():
        for o in src.step():
            want += o.new_token_ids

    def hook(kv, block_ids, num_prompt_tokens, *, num_computed_tokens=0) -> int:
        dst.kv_layout.import_blocks(kv, list(block_ids[: data.shape[0]]), data)
        assert torch.equal(dst.kv_layout.export_blocks(kv, list(block_ids[:4])), data)
        return data.shape[0] * 16

    dst = _engine(model, "fp8", num_blocks=80)  # another pool size: other block ids
    dst.add_request("dst", p, sp, kv_import=hook)
    outs: list[Any] = []
    while dst.has_unfinished():
        outs += dst.step()
    assert outs[-1].num_imported_tokens == 64
    assert [t for o in outs for t in o.new_token_ids] == want


def _layout(kv_dtype: str, dtype: str = "bfloat16") -> tuple[ModelConfig, EngineConfig,
                                                              DenseKVLayout]:
    cfg = ModelConfig.from_json_file(DATA / "qwen3-8b-config.json")
    ec = resolve_engine_config(EngineConfig(model="unused", device="cpu", dtype=dtype,
                                            max_context=4096, chunk_tokens=512, max_batch=4,
                                            kv_dtype=kv_dtype, num_blocks=1030), cfg)
    assert (ec.block_size, ec.attn_tile_tokens) == (16, 256)  # the dense defaults
    return cfg, ec, DenseKVLayout(cfg, ec)


def test_the_plan_counts_one_byte_an_element() -> None:
    """Qwen3-8B (36 layers, 8 KV heads of 128): 2,359,296 B a 16-token block in bf16,
    1,179,648 B in FP8; the kv_cache term and the attention scratch follow the stored dtype."""
    (cfg, ec16, bf16), (_, ec8, fp8) = _layout("auto"), _layout("fp8")
    assert bf16.bytes_per_block == 36 * 2 * 16 * 8 * 128 * 2 == 2_359_296
    assert fp8.bytes_per_block == 36 * 2 * 16 * 8 * 128 * 1 == 1_179_648
    plan16 = make_plan(cfg, ec16, 140 << 30, 16 << 30)
    plan8 = make_plan(cfg, ec8, 140 << 30, 16 << 30)
    assert plan16.term("kv_cache") == 1030 * 2_359_296
    assert plan8.term("kv_cache") == 1030 * 1_179_648 == plan16.term("kv_cache") // 2
    shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ec8.block_size,
                           ec8.attn_tile_tokens)
    ws8 = attention_workspace_bytes(shape, ec8.chunk_tokens, ec8.max_batch, torch.float8_e4m3fn)
    assert plan8.term("ws.attention") == ws8 < plan16.term("ws.attention")
    assert plan8.kv_tokens_per_gib == 2 * plan16.kv_tokens_per_gib


def test_fingerprint_names_fp8_and_keeps_pools_apart() -> None:
    fp8 = _layout("fp8")[2].fingerprint
    assert "fp8-e4m3fn-scale1" in fp8
    assert fp8 != _layout("auto")[2].fingerprint
    assert fp8 == _layout("fp8", dtype="float32")[2].fingerprint  # the model dtype: not stored


def test_fp8_blocks_export_and_import_bit_exactly() -> None:
    """Every byte pattern (NaN encodings included) survives export -> import into other blocks;
    blocks not named are untouched."""
    cfg = ModelConfig.from_hf_dict(build_tiny_model("qwen3").config.to_dict())
    ec = EngineConfig(model="unused", device="cpu", dtype="float32", max_context=64,
                      block_size=16, kv_dtype="fp8")
    layout = DenseKVLayout(cfg, ec)
    src, dst = layout.allocate(9, torch.device("cpu")), layout.allocate(9, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    raw = src.data.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    data = layout.export_blocks(src, [3, 1, 7])
    assert data.dtype == torch.uint8 and data.shape == (3, layout.bytes_per_block)
    layout.import_blocks(dst, [2, 8, 5], data)
    out = dst.data.view(torch.uint8)
    for s, d in ((3, 2), (1, 8), (7, 5)):
        assert torch.equal(out[:, :, d], raw[:, :, s])
    assert not out[:, :, [0, 1, 3, 4, 6, 7]].any()
    assert torch.equal(layout.export_blocks(dst, [2, 8, 5]), data)
