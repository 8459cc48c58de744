"""GPU tier: the fused DeepSeek-V4 decode step with its side lane (step/decode_step.py: the
compressors' updates and the shared expert on a second stream, joined before their results are
read), replayed as CUDA graphs, gives the same greedy tokens as on one stream, with zero device
allocations after warm-up (``strict_allocations``). A missing edge between the lanes, or scratch
or split-K counters shared by both, would part the two runs. The quantized tiny checkpoint of
test_deepseek_v4_quantized (FP8 projections, MXFP4 experts)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, KernelChoices
from engine.llm_engine import LLMEngine

from ._greedy import greedy_tokens
from .test_deepseek_v4_quantized import quantized  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = (23, 9, 40, 17)
NEW = 12


def _tokens(folder, monkeypatch, lanes: int, kv_dtype: str
            ) -> tuple[dict[str, list[int]], LLMEngine]:
    ec = EngineConfig(model=str(folder), device="cuda", dtype="float32", max_context=256,
                      chunk_tokens=64, max_batch=4, block_size=16, attn_tile_tokens=16,
                      strict_allocations=True, kv_dtype=kv_dtype,
                      kernels=KernelChoices(decode="fused", lanes=lanes))
    engine = LLMEngine.from_config(ec)
    assert engine.runner.graphs is not None
    return greedy_tokens(engine, PROMPTS, NEW, seed=11), engine


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])  # fp8: the PyTorch pool writes on the side
def test_v4_side_lane_tokens_equal_one_lane(quantized, monkeypatch, kv_dtype) -> None:  # noqa: F811
    folder, _, _ = quantized
    two, engine = _tokens(folder, monkeypatch, 2, kv_dtype)
    assert engine.runner.num_graph_steps >= NEW - 2
    lane = engine.runner.model.model.__dict__.get("_side_lane")
    assert lane is not None and lane.stream is not None  # the graphs were captured with it
    del engine
    one, _ = _tokens(folder, monkeypatch, 1, kv_dtype)
    assert two == one


def test_recaptured_graphs_switch_lanes_on_one_engine(quantized, monkeypatch) -> None:  # noqa: F811
    """What ``lab.bench.deepseek_v4.decode --lanes 2,1,2`` does between passes: the backend takes
    the other lane count and ``LLMEngine.recapture_graphs`` captures the decode graphs again on
    the same weights. Tokens stay equal across the three captures, the graphs replay, and no
    device allocation follows any capture (strict allocations would raise)."""
    import dataclasses

    folder, _, _ = quantized
    first, engine = _tokens(folder, monkeypatch, 2, "auto")
    v4 = engine.runner.model.model
    for lanes in (1, 2):
        v4.backend = dataclasses.replace(v4.backend, lanes=lanes)
        engine.recapture_graphs()
        steps = engine.runner.num_graph_steps
        assert greedy_tokens(engine, PROMPTS, NEW, seed=11) == first, lanes
        assert engine.runner.num_graph_steps - steps >= NEW - 2
        assert engine.stats().device_allocs_since_warmup == 0
