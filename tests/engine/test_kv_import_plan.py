"""The plan's ``kv_import_slice`` term: whole blocks of the layout, at least one, at most one
sequence's; absent with tensor parallelism (each rank moves its own share of an import)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.errors import PlanError
from engine.memory_planner import make_plan
from engine.model_config import ModelConfig

QWEN3_8B = Path(__file__).resolve().parents[1] / "data" / "qwen3-8b-config.json"


def _plan(**kw: object):
    cfg = ModelConfig.from_json_file(QWEN3_8B)
    ec = EngineConfig(model=str(QWEN3_8B), device="cpu", dtype="bfloat16", block_size=16, **kw)
    return make_plan(cfg, ec, 200 << 30, 16 << 30), ec


def test_the_slice_buffer_is_whole_blocks_between_one_and_a_sequence() -> None:
    # Qwen3-8B in bf16: 36 layers x 2 x 8 KV heads x 128 x 2 B = 147,456 B a token
    plan, _ = _plan(max_context=131072)
    bpb = plan.kv_layout.bytes_per_block
    assert bpb == 16 * 147_456
    assert plan.term("kv_import_slice") == (64 << 20) // bpb * bpb  # the 64 MiB default
    plan, _ = _plan(max_context=131072, kv_import_slice_bytes=1000)  # under one block
    assert plan.term("kv_import_slice") == bpb
    plan, ec = _plan(max_context=256, kv_import_slice_bytes=1 << 40)  # more than a sequence
    assert plan.term("kv_import_slice") == ec.blocks_per_seq * bpb
    assert plan.total_bytes >= plan.term("kv_cache") + plan.term("kv_import_slice")
    plan, _ = _plan(max_context=4096, tensor_parallel_size=2)
    assert plan.term("kv_import_slice") == 0


def test_a_slice_bound_under_one_byte_is_refused() -> None:
    with pytest.raises(PlanError, match="kv_import_slice_bytes must be >= 1"):
        EngineConfig(model="m", kv_import_slice_bytes=0)
