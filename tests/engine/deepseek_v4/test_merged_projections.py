"""Projections of one input merged into one GEMM over concatenated weights (layers/merged_linear.py,
merged_groups.py): the parts' weights and FP8 scale grids become row-slice views of ONE tensor (no resident byte
added, ``state_dict()`` unchanged), the merged GEMM gives what the separate ones give, a part
whose N would split a scale block is left alone, and a loaded toy V4 whose widths are whole
scale blocks (as V4-Flash's are of 128) runs its fused decode step with two FP8 GEMVs fewer a
layer and the same result. CPU tier: Triton through the interpreter (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch import nn

from engine.models.deepseek_v4.layers.merged_linear import MergedLinear, merge_linears
from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear
from kernels.fp8_linear_ref import fp8_linear_ref


def _fp8(n: int, k: int, block: int, seed: int) -> Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Fp8Linear((n, k))
    lin.weight = (torch.randn(n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    lin.scale = torch.rand(-(-n // block), -(-k // block), generator=g) * 1e-2 + 1e-3
    lin.block = (block, block)
    return lin


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("use_kernels", [False, True])
def test_fp8_parts_become_views_of_one_tensor(use_kernels: bool) -> None:
    if use_kernels:
        pytest.importorskip("triton")
    parts = [_fp8(32, 64, 16, 1), _fp8(16, 64, 16, 2), _fp8(40, 64, 16, 3)]  # last: partial block
    holder = nn.ModuleList(parts)
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    old_bytes = _storage_bytes([t for p in parts for t in (p.weight, p.scale)])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    want = [fp8_linear_ref(x, p.weight, p.scale, p.block) for p in parts]
    merged = merge_linears(parts)
    assert isinstance(merged, MergedLinear)
    assert merged.weight.shape == (88, 64) and merged.scale.shape == (2 + 1 + 3, 4)
    after = holder.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():  # same names, shapes and values
        assert after[k].shape == v.shape and torch.equal(after[k].view(torch.uint8) if v.dtype
                                                         == torch.float8_e4m3fn else after[k],
                                                         v.view(torch.uint8) if v.dtype ==
                                                         torch.float8_e4m3fn else v), k
    for p in parts:  # views into the merged tensors: nothing resident beyond them
        assert p.weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
        assert p.scale.untyped_storage().data_ptr() == merged.scale.untyped_storage().data_ptr()
        assert p.weight.is_contiguous() and p.scale.is_contiguous()
    new_bytes = _storage_bytes([t for p in parts for t in (p.weight, p.scale)])
    assert new_bytes == old_bytes == merged.weight.nbytes + merged.scale.nbytes
    assert merged.intact()
    for p in parts:
        p.use_kernels = use_kernels
    outs = merged(x)
    base = outs[0]._base if outs[0]._base is not None else outs[0]
    for got, ref, p in zip(outs, want, parts, strict=True):
        assert got._base is base or got.data_ptr() >= base.data_ptr()  # views, no copies
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(p(x), ref, rtol=1e-4, atol=1e-4)  # the part alone still works


def test_fp8_parts_that_split_a_scale_block_stay_apart() -> None:
    parts = [_fp8(24, 64, 16, 1), _fp8(32, 64, 16, 2)]  # 24 rows: half a 16-row block
    w = [p.weight for p in parts]
    assert merge_linears(parts) is None
    assert all(p.weight is t for p, t in zip(parts, w, strict=True))
    other = _fp8(32, 64, 16, 3)
    other.block = (32, 16)
    other.scale = torch.ones(1, 4)
    assert merge_linears([_fp8(32, 64, 16, 4), other]) is None  # different blocks


def test_linear_parts_and_the_broken_view_fallback() -> None:
    g = torch.Generator().manual_seed(0)
    parts = [nn.Linear(16, n, bias=False) for n in (8, 5, 3)]
    for p in parts:
        p.weight.data = torch.randn(p.weight.shape, generator=g)
    x = torch.randn(2, 16, generator=g)
    want = [p(x) for p in parts]
    merged = merge_linears(parts)
    assert merged is not None and merged.weight.shape == (16, 16)
    for got, ref in zip(merged(x), want, strict=True):
        torch.testing.assert_close(got, ref)
    assert all(isinstance(p.weight, nn.Parameter) for p in parts)
    assert merge_linears([nn.Linear(16, 4), nn.Linear(16, 4)]) is None  # biases
    parts[1].weight = nn.Parameter(parts[1].weight.detach().clone() * 2)  # no longer a view
    assert not merged.intact()
    torch.testing.assert_close(merged(x)[1], want[1] * 2)  # falls back to the parts


def _toy(layers: str):  # noqa: ANN202
    from lab.bench.deepseek_v4.context import flash_config
    from lab.bench.deepseek_v4.quantized_weights import (
        reblock_fp8_scales,
        synthetic_quantized_state_dict,
    )

    cfg = flash_config(layers, 8, 256, tiny=True)
    # widths of two 16-row scale blocks or more (a one-row grid reads as one 128 block)
    cfg = dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32, q_lora_rank=32,
                              head_dim=32)
    return cfg, reblock_fp8_scales(synthetic_quantized_state_dict(cfg, "cpu", torch.float32), 16)


def test_loaded_model_merges_without_growing() -> None:
    from engine.models.deepseek_v4 import DeepseekV4Model
    from engine.models.deepseek_v4.weights.quant_weights import resident_weight_bytes

    cfg, sd = _toy("CH")
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    model = DeepseekV4Model.from_state_dict(cfg, sd, torch.float32, "cpu")
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.merged_x is not None and attn.merged_x.scale is not None  # FP8 q_a + kv
        assert attn.merged_comp is not None and attn.merged_comp.scale is None  # bf16 group
        assert layer.mlp.shared_experts.merged_gate_up is not None
    assert len(model.model.layers[0].self_attn.merged_comp.parts) == 5  # CSA: + the indexer's
    assert len(model.model.layers[1].self_attn.merged_comp.parts) == 2  # HCA
    own = model.state_dict()
    own = {k: v for k, v in own.items() if "rotary" not in k}
    assert {k: tuple(v.shape) for k, v in own.items()} == shapes
    held = _storage_bytes(list(own.values()))
    assert held == sum(v.nbytes for v in own.values())  # every byte once, none added
    assert held == resident_weight_bytes(sd, torch.float32, "checkpoint")


def test_consumed_state_dict_gives_up_the_merged_originals() -> None:
    from engine.models.deepseek_v4 import DeepseekV4Model

    cfg, sd = _toy("C")
    before = set(sd)
    model = DeepseekV4Model.from_state_dict(cfg, sd, torch.float32, "cpu", consume=True)
    p = "model.layers.0."
    # (the toy's e8m0 scale grids are not the model's fp32 ones: the caller keeps those)
    gone = {p + f"self_attn.{m}.weight" for m in ("q_a_proj", "kv_proj")}
    gone |= {p + f"mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj")}
    gone |= {p + f"self_attn.compressor.{m}.weight" for m in (
        "kv_proj", "gate_proj", "indexer.kv_proj", "indexer.gate_proj", "indexer.scorer.weights_proj")}
    # the caller's references to every pre-merge tensor are dropped (freed as each group
    # merged), the rest stays as it was
    assert gone <= before and not gone & set(sd)
    assert p + "self_attn.q_b_proj.weight" in sd
    assert model.model.layers[0].self_attn.merged_x is not None


@pytest.mark.slow
def test_fused_decode_takes_the_merged_gemvs() -> None:
    pytest.importorskip("triton")
    import triton.runtime.interpreter as interp

    from engine.models.deepseek_v4 import DeepseekV4KVPool, DeepseekV4Model, V4Backend
    from engine.models.deepseek_v4.layers.merged_groups import unmerge_projections

    cfg, sd = _toy("CH")
    ids = torch.randint(2, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    results = {}
    for merged in (True, False):
        model = DeepseekV4Model.from_state_dict(
            cfg, sd, torch.float32, "cpu", V4Backend("kernels", "kernels", "kernels", decode="fused"))
        if not merged:
            unmerge_projections(model)
        cache = DeepseekV4KVPool.for_slots(cfg, 1, 32, torch.float32, "cpu")
        prefill = model(ids[:11], torch.arange(11), [0, 11], [0], cache)
        launches: Counter[str] = Counter()
        run = interp.InterpretedFunction.run

        def counted(self, *args, _n=launches, _run=run, **kwargs):  # type: ignore[no-untyped-def]
            _n[self.fn.__name__] += 1
            return _run(self, *args, **kwargs)

        interp.InterpretedFunction.run = counted  # type: ignore[method-assign]
        try:
            dec = model(ids[11:12], torch.tensor([11]), [0, 1], [0], cache)
        finally:
            interp.InterpretedFunction.run = run  # type: ignore[method-assign]
        results[merged] = (prefill, dec, launches["_fp8_gemv_kernel"])
    (p1, d1, g1), (p0, d0, g0) = results[True], results[False]
    torch.testing.assert_close(p1, p0, rtol=1e-4, atol=1e-4)  # prefill through the merged GEMMs
    torch.testing.assert_close(d1, d0, rtol=1e-4, atol=1e-4)
    assert g1 == g0 - 2 * cfg.num_layers, (g1, g0)  # q_a + kv and gate + up: one GEMV each


def test_planner_counts_the_merged_gemv_scratch() -> None:
    from engine.models.deepseek_v4.memory.sizing import fp8_gemv_split_bytes
    from kernels.fp8_linear import fp8_linear_scratch_bytes
    from lab.bench.deepseek_v4.context import flash_config

    cfg = flash_config("SCHC", 256, 4096)  # V4-Flash's widths: both merges happen
    hid, ql, d, inter = cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim, cfg.moe_intermediate_size
    for rows in (1, 7, 32):
        need = max(fp8_linear_scratch_bytes(rows, n, hid) for n in (ql + d, 2 * inter))
        assert 0 < need <= fp8_gemv_split_bytes(cfg, rows)
