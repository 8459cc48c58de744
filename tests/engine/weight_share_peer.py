"""A separate OS process that builds a CUDA engine in one-box mode (test helper).

Usage: python tests/engine/weight_share_peer.py SPEC.json OUT.json. SPEC: model folder, handle
path, prompts, tokens to generate, and a file whose appearance tells an exporter it may exit
(the importer's mapping is only valid while the exporter lives). OUT: greedy tokens, the plan,
whether the weights were owned, and device memory figures.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    ec = EngineConfig(model=spec["model"], device="cuda", max_context=256, chunk_tokens=64,
                      max_batch=2, memory_utilization=0.1, strict_allocations=True,
                      share_weights=spec["handle"])
    engine = LLMEngine.from_config(ec)
    for i, p in enumerate(spec["prompts"]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=spec["n"], temperature=0,
                                                     ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(spec["prompts"]))}
    while engine.has_unfinished():
        for r in engine.step():
            tokens[r.request_id] += r.new_token_ids
    shared = engine.shared_weights
    out = {"tokens": [tokens[str(i)] for i in range(len(spec["prompts"]))],
           "owned": shared.owned, "arena_bytes": shared.nbytes,
           "plan": engine.plan.to_json(), "reserved": torch.cuda.memory_reserved(),
           "allocs_after_warmup": engine.stats().device_allocs_since_warmup}
    Path(sys.argv[2]).write_text(json.dumps(out))
    if shared.owned:  # keep the arena alive until the importer is done with it
        deadline = time.monotonic() + 300
        while not Path(spec["release"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)


if __name__ == "__main__":
    main()
