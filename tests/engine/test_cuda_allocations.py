"""GPU tier: after the worst-case warm-up, serving makes no new device allocations."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import build_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_no_device_allocation_after_warmup(dtype):
    model = build_tiny_model("qwen3", hidden_size=256, intermediate_size=704,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             vocab_size=4096, num_hidden_layers=4, max_position_embeddings=8192)
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    dt = getattr(torch, dtype)
    weights = {k: v.to("cuda", dt) for k, v in model.state_dict().items()}
    ec = EngineConfig(model="tiny", device="cuda", dtype=dtype, max_context=4096,
                      chunk_tokens=512, max_batch=16, block_size=16, attn_tile_tokens=256,
                      strict_allocations=True)
    engine = LLMEngine(ec, cfg, weights)
    g = torch.Generator().manual_seed(0)
    lengths = [1, 17, 300, 1000, 2047, 3000, 4000, 5, 77, 513]
    for i, n in enumerate(lengths):
        sp = SamplingParams(max_tokens=min(64, 4096 - n), temperature=0.0 if i % 2 else 0.8,
                            top_p=0.9, seed=i, ignore_eos=True)
        engine.add_request(f"r{i}", torch.randint(0, 4096, (n,), generator=g).tolist(), sp)
    steps = 0
    while engine.has_unfinished():
        engine.step()  # strict mode raises DeviceAllocationAfterLock naming the step
        steps += 1
    stats = engine.stats()
    assert steps > 50
    assert stats.device_allocs_since_warmup == 0
    rep = engine.warmup_report
    print(f"\n{dtype}: warm-up workspace peak {rep.workspace_peak_bytes} / "
          f"{rep.workspace_capacity_bytes} B; activations measured {rep.activation_peak_bytes} "
          f"vs planned {rep.activation_planned_bytes} B; {steps} steps, 0 allocations after lock")
    assert rep.activation_peak_bytes <= rep.activation_planned_bytes
