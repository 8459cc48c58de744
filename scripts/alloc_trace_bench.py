"""Diagnostic (GPU): the bench.engine decode flow with strict allocation checks off, printing the
stack of every segment the allocator maps after warm-up."""

import torch

from bench.engine import _decode_tps, _hf_model
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig

model = _hf_model("smollm2-135m")
cfg = ModelConfig.from_hf_dict(model.config.to_dict())
eng = LLMEngine(EngineConfig(model="b", device="cuda", dtype="bfloat16", max_context=512,
                             chunk_tokens=4096, max_batch=64, strict_allocations=False),
                cfg, dict(model.state_dict()))
torch.cuda.memory._record_memory_history(max_entries=500000)
for b in (1, 16, 64):
    print(b, _decode_tps(eng, b, 128, 16), eng.stats().device_allocs_since_warmup, flush=True)
snap = torch.cuda.memory._snapshot()
seen = 0
for trace in snap["device_traces"]:
    for ev in trace:
        if ev["action"] in ("segment_alloc", "segment_map") and seen < 6:
            seen += 1
            frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                      for f in ev.get("frames", [])
                      if "/work/main/" in f["filename"]]
            print(ev["action"], ev["size"], frames[:8])
