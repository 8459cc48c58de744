"""Diagnostic (GPU): which allocations reach the device after the engine's warm-up, with stacks.

python scripts/alloc_trace.py  -> prints each segment allocation after warm-up and our frames.
"""

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import build_tiny_model

model = build_tiny_model("qwen3", hidden_size=256, intermediate_size=704, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, vocab_size=4096,
                         num_hidden_layers=4, max_position_embeddings=8192)
cfg = ModelConfig.from_hf_dict(model.config.to_dict())
weights = {k: v.to("cuda", torch.bfloat16) for k, v in model.state_dict().items()}
ec = EngineConfig(model="tiny", device="cuda", dtype="bfloat16", max_context=4096, chunk_tokens=512,
                  max_batch=16, strict_allocations=False)
engine = LLMEngine(ec, cfg, weights)
print("graph pool", engine.runner.graphs.pool_bytes if engine.runner.graphs else None,
      "planned", engine.plan.term("cuda_graph_pool"))
torch.cuda.memory._record_memory_history(max_entries=200000)
g = torch.Generator().manual_seed(0)
for i, n in enumerate([1, 17, 300, 1000, 2047, 3000, 4000, 5, 77, 513]):
    sp = SamplingParams(max_tokens=min(64, 4096 - n), temperature=0.0 if i % 2 else 0.8,
                        top_p=0.9, seed=i, ignore_eos=True)
    engine.add_request(f"r{i}", torch.randint(0, 4096, (n,), generator=g).tolist(), sp)
steps = 0
while engine.has_unfinished():
    before = torch.cuda.memory_stats()["num_device_alloc"]
    engine.step()
    steps += 1
    after = torch.cuda.memory_stats()["num_device_alloc"]
    if after != before:
        print(f"step {steps}: +{after - before} device allocs")
snap = torch.cuda.memory._snapshot()
for trace in snap["device_traces"]:
    for ev in trace:
        if ev["action"] in ("segment_alloc", "segment_map"):
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                      for f in ev.get("frames", []) if "bulkhead" in f["filename"]
                      or "/engine/" in f["filename"] or "/kernels/" in f["filename"]]
            print(ev["action"], ev["size"], "stream", ev.get("stream"), frames[:6])
print("steps", steps, "allocs since warmup", engine.stats().device_allocs_since_warmup,
      "graph steps", engine.runner.num_graph_steps)
