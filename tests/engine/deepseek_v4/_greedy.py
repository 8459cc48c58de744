"""Greedy tokens of random prompts through an LLMEngine (the GPU tier's token comparisons)."""

from __future__ import annotations

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def greedy_tokens(engine: LLMEngine, prompts: tuple[int, ...], new: int, seed: int = 7
                  ) -> dict[str, list[int]]:
    """Request ``r{i}``: ``prompts[i]`` random token ids, ``new`` greedy tokens (EOS ignored),
    all in the engine at once; -> the tokens of each request."""
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(prompts):
        engine.add_request(f"r{i}", torch.randint(2, 97, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out
