"""The plan of a DeepSeek-V4 step against what the step takes.

GPU tier: LLMEngine's worst-case warm-up on an H200 at V4-Flash's layer dimensions (weights in
the shipped FP8/MXFP4 formats, synthetic values) measures the transient peak; it must be inside
the plan's ``activations`` term and within 10% of it, for prefill chunks, decode batches and
long contexts. CPU tier: the formula's moments move the way the code's tensors do."""

from __future__ import annotations

import argparse

import pytest
import torch

from bench.deepseek_v4.context import flash_config
from engine.models.deepseek_v4.step_peak import (
    deepseek_v4_kernels_peak_bytes,
    deepseek_v4_kernels_step_bytes,
)


def test_entries_bounded_by_the_pool_and_flat_without_them() -> None:
    cfg = flash_config("SCH", 8, 1 << 20)
    lone = deepseek_v4_kernels_step_bytes(cfg, 4096, 1 << 20, 8)
    pooled = deepseek_v4_kernels_step_bytes(cfg, 4096, 1 << 20, 8, kv_tokens=1 << 20)
    # eight sequences cannot all be 1M long in a pool of 1M tokens: a quarter of the entries
    assert pooled["attention"] < lone["attention"]
    short = deepseek_v4_kernels_step_bytes(cfg, 4096, 4096, 8)
    assert short["moe"] == lone["moe"] and short["mhc_merge"] == lone["mhc_merge"]
    # the context enters only through the gathered entries: 1M / 4 rows of 512 bf16 (+ the table)
    growth = pooled["attention"] - deepseek_v4_kernels_step_bytes(cfg, 4096, 4096, 1)["attention"]
    assert growth < 3 * (1 << 18) * 512 * 2
    fp8 = deepseek_v4_kernels_step_bytes(cfg, 4096, 1 << 20, 8, kv_tokens=1 << 20, kv_fp8=True)
    assert fp8["attention"] > pooled["attention"]  # widening FP8 rows to fp32 on the way out
    assert deepseek_v4_kernels_peak_bytes(pooled) >= pooled["resident"] + pooled["attention"]


def _engine_args(chunk: int, batch: int, context: int) -> argparse.Namespace:
    return argparse.Namespace(
        device="cuda", dtype="bf16", layers="SCH", experts=16, context=context, tiny=False,
        chunk=chunk, batch_list=[batch], block_size=256, num_blocks=None, kv_dtype="auto",
        weights="fp8-mxfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,batch,context", [(4096, 1, 32768), (4096, 8, 16384),
                                                 (2048, 4, 131072), (512, 32, 8192)])
def test_warmup_peak_within_ten_percent_of_the_plan(chunk: int, batch: int, context: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from bench.deepseek_v4.decode import build_engine

    engine, _ = build_engine(_engine_args(chunk, batch, context))
    rep = engine.warmup_report
    ratio = rep.activation_peak_bytes / rep.activation_planned_bytes
    print(f"chunk {chunk} batch {batch} context {context}: measured {rep.activation_peak_bytes:,}"
          f" B, planned {rep.activation_planned_bytes:,} B, ratio {ratio:.3f}")
    del engine
    torch.cuda.empty_cache()
    assert 0.9 <= ratio <= 1.0
