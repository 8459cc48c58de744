"""The sizes an operator leaves to the model (engine/config_resolve.py): the block size from the
family (a multiple of a sparse model's compression rates), the attention tile in whole blocks,
max_context auto (the longest that fits on CUDA, min(4096, the model's limit) elsewhere), and
refusals that name a value that would work; plus the one-card budget split (memory_share)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine.config import EngineConfig, KernelChoices
from engine.config_resolve import CPU_AUTO_CONTEXT, longest_fitting_context, resolve_engine_config
from engine.errors import PlanError
from engine.memory_plan import GiB
from engine.memory_planner import make_plan
from engine.model_config import ModelConfig

DATA = Path(__file__).resolve().parents[1] / "data"


def _qwen3() -> ModelConfig:
    return ModelConfig.from_json_file(DATA / "qwen3-8b-config.json")


def _v4(csa: int = 4, hca: int = 128) -> ModelConfig:
    d = json.loads((DATA / "deepseek-v4-flash-config.json").read_text())
    d.update(compress_rate_csa=csa, compress_rate_hca=hca)
    return ModelConfig.from_hf_dict(d, name="v4")


def test_dense_defaults_block_16_tile_256_and_cpu_context() -> None:
    ec = resolve_engine_config(EngineConfig(model="m", device="cpu"), _qwen3())
    assert (ec.block_size, ec.attn_tile_tokens) == (16, 256)
    assert ec.max_context == CPU_AUTO_CONTEXT and ec.is_resolved


def test_auto_context_never_passes_the_model_limit() -> None:
    small = dataclasses.replace(_qwen3(), max_position_embeddings=1000)
    assert resolve_engine_config(EngineConfig(model="m", device="cpu"), small).max_context == 1000


def test_v4_block_size_is_256_in_multiples_of_its_rates() -> None:
    ec = resolve_engine_config(EngineConfig(model="m", device="cpu"), _v4())
    assert ec.block_size == 256  # V4-Flash: rates 4 and 128
    odd = _v4(4, 24)  # lcm 24 does not divide 256: the next multiple
    ec = resolve_engine_config(EngineConfig(model="m", device="cpu"), odd)
    assert ec.block_size == 264 and ec.attn_tile_tokens == 264


def test_a_forbidden_block_size_names_one_that_works() -> None:
    with pytest.raises(PlanError, match=r"block_size=16 must be a multiple of 128.*128 would do"):
        resolve_engine_config(EngineConfig(model="m", device="cpu", block_size=16), _v4())
    with pytest.raises(PlanError, match="attn_tile_tokens=100 must be a multiple of block_size=16; "
                                        "112 would do"):
        EngineConfig(model="m", block_size=16, attn_tile_tokens=100)


def test_set_values_are_kept() -> None:
    ec = resolve_engine_config(EngineConfig(model="m", device="cpu", block_size=32,
                                            attn_tile_tokens=64, max_context=777), _qwen3())
    assert (ec.block_size, ec.attn_tile_tokens, ec.max_context) == (32, 64, 777)


def test_cuda_auto_is_the_longest_whole_block_context_that_fits() -> None:
    ec = EngineConfig(model="m", device="cpu", block_size=16, attn_tile_tokens=256)
    for cap in (16, 17, 1000, 4096, 40000):
        got = longest_fitting_context(ec, 40960, lambda c, cap=cap: c.max_context <= cap)
        assert got == min(40960, cap // 16 * 16 or 16)
    # nothing fits: the smallest candidate, so the plan's own error names the terms
    assert longest_fitting_context(ec, 40960, lambda c: False) == 16


def test_cuda_auto_fits_the_plan_of_a_96gb_card() -> None:
    """Qwen3-8B on a 96 GiB card, 8 sequences: each reaches the context auto picks, the plan
    fits, and one block more would not."""
    model, memory, weights = _qwen3(), 96 * GiB, int(16.4 * GiB)
    ec = EngineConfig(model="m", device="cuda", dtype="bfloat16", max_batch=8)

    def fits(c: EngineConfig) -> bool:
        return make_plan(model, c, memory, weights).fits

    got = resolve_engine_config(ec, model, fits)
    assert 16 * 1024 < got.max_context <= model.max_position_embeddings
    assert fits(got)
    if got.max_context < model.max_position_embeddings:
        assert not fits(dataclasses.replace(got, max_context=got.max_context + got.block_size))


def test_memory_share_splits_what_the_weights_leave() -> None:
    model, memory, weights = _qwen3(), 96 * GiB, 16 * GiB
    ec = EngineConfig(model="m", device="cuda", dtype="bfloat16", max_context=8192,
                      memory_utilization=0.9)
    whole = make_plan(model, ec, memory, weights)
    owner = make_plan(model, dataclasses.replace(ec, memory_share=0.25), memory, weights)
    mapper = make_plan(model, dataclasses.replace(ec, memory_share=0.75), memory, 0,
                       mapped_weight_bytes=weights)
    rest = int(memory * 0.9) - weights
    assert whole.budget_bytes == int(memory * 0.9)
    assert owner.budget_bytes == int(0.25 * rest) + weights
    assert mapper.budget_bytes == int(0.75 * rest)
    assert owner.budget_bytes + mapper.budget_bytes <= whole.budget_bytes + 1


def test_kernel_choices_are_checked_where_they_are_set() -> None:
    with pytest.raises(PlanError, match="kernels.decode='fast' is not one of auto, fused"):
        KernelChoices(decode="fast")
    with pytest.raises(PlanError, match="kernels.lanes=3"):
        KernelChoices(lanes=3)
