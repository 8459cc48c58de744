"""GPU tier: the fused DeepSeek-V4 decode step replayed as CUDA graphs gives the same greedy
tokens with programmatic dependent launch (the default on sm_90+) as with it switched off
(``BULKHEAD_PDL=0``), in the default mode and with the early trigger and weight prefetch. A
kernel that touched memory before its wait would read its predecessor's outputs half-written
and part the two runs. The quantized tiny checkpoint of
test_deepseek_v4_quantized (FP8 projections, MXFP4 experts)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, KernelChoices
from engine.llm_engine import LLMEngine
from kernels import pdl_launch

from ._greedy import greedy_tokens
from .test_deepseek_v4_quantized import quantized  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = (23, 9, 40)
NEW = 10


def _tokens(folder) -> tuple[dict[str, list[int]], int]:
    ec = EngineConfig(model=str(folder), device="cuda", dtype="float32", max_context=128,
                      chunk_tokens=64, max_batch=4, block_size=16, attn_tile_tokens=16,
                      strict_allocations=True, kernels=KernelChoices(decode="fused"))
    engine = LLMEngine.from_config(ec)
    assert engine.runner.graphs is not None
    return greedy_tokens(engine, PROMPTS, NEW), engine.runner.num_graph_steps


@pytest.mark.parametrize("mode", ["1", "trigger+prefetch"])
def test_v4_pdl_tokens_equal_no_pdl(quantized, monkeypatch, mode) -> None:  # noqa: F811
    monkeypatch.setenv("BULKHEAD_PDL", mode)
    if not pdl_launch(torch.device("cuda")):
        pytest.skip("PDL is off on this device (needs compute capability 9 or more)")
    folder, _, _ = quantized
    with_pdl, graph_steps = _tokens(folder)
    assert graph_steps >= NEW - 2
    monkeypatch.setenv("BULKHEAD_PDL", "0")
    assert not pdl_launch(torch.device("cuda"))
    without, _ = _tokens(folder)
    assert with_pdl == without
