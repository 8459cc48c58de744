"""The plan of a DeepSeek-V4 step against what the step takes.

GPU tier: LLMEngine's worst-case warm-up on an H200 at V4-Flash's layer dimensions (weights in
the shipped FP8/MXFP4 formats, synthetic values) measures the transient peak; it must be inside
the plan's ``activations`` term and within 10% of it, for prefill chunks, decode batches and
long contexts. CPU tier: the formula's moments move the way the code's tensors do, and the same
warm-up on the CUDA code path, its tensors counted on the CPU (lab.bench.deepseek_v4.step_trace:
Triton launches skipped, every allocation kept), peaks inside the formula and within 10% of it."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
import torch

from engine.models.deepseek_v4.memory.step_peak import (
    deepseek_v4_kernels_peak_bytes,
    deepseek_v4_kernels_step_bytes,
)
from lab.bench.deepseek_v4.context import flash_config


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


@pytest.mark.parametrize("chunk,batch,context", [(320, 2, 1536), (250, 3, 1100)])
def test_counted_warmup_peak_within_ten_percent_of_the_plan(chunk: int, batch: int,
                                                            context: int) -> None:
    # V4-Flash's layer dimensions (heads, head_dim 512, indexer, mHC streams, window) at a small
    # vocabulary and 4 experts, so the weights are made in seconds; chunks, batches and contexts
    # that are not multiples of the 256-token block. A transient added to the code without its
    # term, or a term left after its tensor is gone, moves the ratio out of the band.
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU count runs the kernels' wrappers through the Triton interpreter")
    from lab.bench.deepseek_v4.step_trace import engine_config, trace_warmup

    cfg = dataclasses.replace(flash_config("SCH", 4, context), vocab_size=1000)
    t = trace_warmup(cfg, engine_config(chunk, batch, context), stacks=False)
    # the chunk at the longest context, the decode batch, mixed, decodes beside a chunk
    assert len(t.step_peaks) == 4
    assert t.peak == max(t.step_peaks.values())
    assert t.peak <= t.planned, t.tracker.report(20)
    assert t.peak >= 0.9 * t.planned, t.tracker.report(20)


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
    from lab.bench.deepseek_v4.decode import build_engine

    engine, _ = build_engine(_engine_args(chunk, batch, context))
    rep = engine.warmup_report
    ratio = rep.activation_peak_bytes / rep.activation_planned_bytes
    print(f"chunk {chunk} batch {batch} context {context}: measured {rep.activation_peak_bytes:,}"
          f" B, planned {rep.activation_planned_bytes:,} B, ratio {ratio:.3f}")
    del engine
    torch.cuda.empty_cache()
    assert 0.9 <= ratio <= 1.0


@pytest.mark.gpu
def test_allocator_reading_matches_the_counted_tensors() -> None:
    # The engine's warm-up reading (max_memory_allocated - base) against the tensors the same
    # warm-up holds, counted over the real kernels: equal to the allocator's rounding, unless
    # memory that existed before the warm-up is freed during it (then the reading is low and
    # the plan looks looser than it is). The listing names the tensors alive at the peak.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lab.bench.deepseek_v4.step_trace import engine_config, trace_warmup

    t = trace_warmup(flash_config("SCH", 16, 32768), engine_config(4096, 1, 32768, device="cuda"))
    msg = (f"counted {t.peak:,} B, allocator {t.allocator_peak:,} B, memory_allocated - base at "
           f"the counted peak {t.allocated_at_peak:,} B, planned {t.planned:,} B\n"
           + t.tracker.report(30))
    print(msg)
    torch.cuda.empty_cache()
    assert t.allocator_peak is not None and t.allocated_at_peak is not None
    assert abs(t.allocator_peak - t.peak) <= 0.01 * t.peak, msg
    assert t.peak <= t.planned, msg
