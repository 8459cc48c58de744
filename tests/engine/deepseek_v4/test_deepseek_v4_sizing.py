"""Planner inputs and the context-sweep script: size functions agree with what is allocated,
scratch does not grow with context where it must not, loading reports bad checkpoints, and the
sweep script runs end to end (tiny dims on CPU) and writes its report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import CheckpointError
from engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4KVPool, DeepseekV4Model
from engine.models.deepseek_v4.memory.extent import deepseek_v4_cache_bytes
from engine.models.deepseek_v4.memory.sizing import (
    deepseek_v4_step_peak_bytes,
    deepseek_v4_step_scratch_bytes,
)
from lab.bench.deepseek_v4.context import flash_config, main


def test_flash_cache_bytes_by_role() -> None:
    cfg = flash_config("SCH", experts=8, context=1 << 20)
    got = deepseek_v4_cache_bytes(cfg, max_batch=2, max_context=1 << 20)
    blocks = 1 + 2 * (1 << 20) // 128  # blocks of lcm(4, 128) tokens, + the null block
    assert got["csa_entries"] == blocks * 32 * 512 * 2  # 128 / 4 entries a block
    assert got["hca_entries"] == blocks * 1 * 512 * 2
    assert got["indexer_keys"] == blocks * 32 * 128 * 2
    # no window rows in blocks: 4 x max_batch snapshots of the 128-row window beside them
    assert "sliding_window" not in got
    assert got["resume_windows"] == 4 * 2 * 3 * 128 * 512 * 2
    assert got["compressor_carry"] == blocks * 4 * (512 + 128) * (2 + 4)
    assert got["slot_carry"] == 2 * (3 * 128 * 512 * 2 + 2 * 4 * 1024 * 2 + 2 * 4 * 256 * 2
                                     + 2 * 128 * 512 * 2)
    fp8 = deepseek_v4_cache_bytes(cfg, max_batch=2, max_context=1 << 20, fp8=True)
    assert fp8["csa_entries"] == blocks * 32 * (512 + 4)
    assert fp8["resume_windows"] == 4 * 2 * 3 * 128 * (512 + 4)


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_step_scratch_flat_in_context_past_one_tile(backend: str) -> None:
    """Only HCA's visible entries (torch backend) grow with max_context; the indexer does not."""
    cfg = flash_config("SCH", experts=8, context=1 << 20)
    small = deepseek_v4_step_scratch_bytes(cfg, 4096, 1 << 17, 1, backend=backend)
    big = deepseek_v4_step_scratch_bytes(cfg, 4096, 1 << 20, 1, backend=backend)
    assert small["indexer"] == big["indexer"]
    assert small["moe"] == big["moe"] and small["mhc_streams"] == big["mhc_streams"]
    peak = deepseek_v4_step_peak_bytes(big)
    assert big["mhc_streams"] < peak <= sum(big.values())


def test_from_state_dict_dtypes_and_errors(v4_builder: Callable[..., Any]) -> None:
    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    cfg = DeepseekV4Config.from_hf_dict(raw)
    sd = model.state_dict()
    ours = DeepseekV4Model.from_state_dict(cfg, sd, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in ours.named_parameters()}
    assert dtypes["model.layers.1.self_attn.q_b_proj.weight"] == torch.bfloat16
    for kept in ("model.layers.1.self_attn.sinks", "model.layers.0.attn_hc.fn", "model.norm.weight",
                 "model.layers.1.self_attn.compressor.indexer.position_bias"):
        assert dtypes[kept] == torch.float32, kept
    missing = {k: v for k, v in sd.items() if "indexer.q_b_proj" not in k}
    with pytest.raises(CheckpointError, match="missing"):
        DeepseekV4Model.from_state_dict(cfg, missing)
    bad = dict(sd)
    bad["model.layers.0.self_attn.kv_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match="kv_proj"):
        DeepseekV4Model.from_state_dict(cfg, bad)


def test_bf16_prefill_close_to_fp32(v4_builder: Callable[..., Any]) -> None:
    """bf16 weights/state (fp32 where transformers keeps fp32) stay near the fp32 logits."""
    model, raw = v4_builder("csa-hca-csa-s_hc3_topk_all")
    cfg = DeepseekV4Config.from_hf_dict(raw)
    ids = torch.randint(2, 97, (29,), generator=torch.Generator().manual_seed(3))
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        ours = DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=dtype)
        cache = DeepseekV4KVPool.for_slots(cfg, 1, 32, dtype, "cpu")
        h = torch.cat([ours(ids[s : s + 8], torch.arange(s, min(29, s + 8)), [0, min(29, s + 8) - s], [0], cache)
                       for s in range(0, 29, 8)])
        outs.append(ours.compute_logits(h).float())
    assert (outs[0] - outs[1]).abs().max() < 0.05 * outs[0].abs().max()


def test_bench_context_script_runs_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["run", "--device", "cpu", "--tiny", "--context", "96", "--chunk", "20",
                 "--indexers", "torch,naive", "--out", str(out), "--check-tokens", "24"]) == 0
    res = json.loads(out.read_text())
    assert [r["indexer"] for r in res] == ["torch", "naive"]
    assert [row["context_end"] for row in res[0]["rows"]] == [20, 40, 60, 80, 96]
    assert res[0]["backend_agreement"]["relative_l2_diff"] < 1e-2
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "deepseek_v4.md").write_text("# title\n")
    assert main(["report", str(out), "--docs", str(docs)]) == 0
    text = (docs / "deepseek_v4.md").read_text()
    assert text.startswith("# title") and "indexer `naive`" in text and "| 96 |" in text
    assert (tmp_path / "lab" / "results" / "deepseek_v4_context.png").stat().st_size > 0
    assert "](../lab/results/deepseek_v4_context.png)" in text


def test_size_functions_take_the_engine_model_config(v4_builder: Callable[..., Any], tmp_path: Path) -> None:
    """The planner holds an engine ModelConfig: the size functions read it directly."""
    from engine.checkpoint import load_model_config
    from engine.models.deepseek_v4.memory.sizing import deepseek_v4_workspace_bytes

    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    model.config.save_pretrained(tmp_path)
    mc = load_model_config(tmp_path)
    cfg = DeepseekV4Config.from_hf_dict(raw)
    assert deepseek_v4_cache_bytes(mc, 3, 100) == deepseek_v4_cache_bytes(cfg, 3, 100)
    assert deepseek_v4_step_scratch_bytes(mc, 16, 100, 3) == deepseek_v4_step_scratch_bytes(cfg, 16, 100, 3)
    assert deepseek_v4_workspace_bytes(mc, 16, 100) > 0
    with pytest.raises(CheckpointError, match="cannot read"):
        DeepseekV4Config.coerce(object())


def test_warmup_at_longest_context() -> None:
    """pretend_filled lets a warm-up step run against the longest context the extent holds."""
    from engine.errors import InvalidRequest
    from lab.bench.deepseek_v4.context import random_init_

    cfg = flash_config("SCH", experts=4, context=256, tiny=True)
    model = DeepseekV4Model.empty(cfg, torch.float32, "cpu")
    random_init_(model, seed=0)
    cache = DeepseekV4KVPool.for_slots(cfg, 2, 256, torch.float32, "cpu")
    cache.pretend_filled(1, 240)
    h = model(torch.randint(0, cfg.vocab_size, (16,)), torch.arange(240, 256), [0, 16], [1], cache)
    assert torch.isfinite(h).all() and cache.num_tokens == [0, 256]
    cache.reset_slot(1)
    with pytest.raises(InvalidRequest, match="outside"):
        cache.pretend_filled(0, 257)
