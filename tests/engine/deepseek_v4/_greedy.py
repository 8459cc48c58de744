"""Greedy tokens of random prompts through an LLMEngine (the GPU tier's token comparisons)."""

from __future__ import annotations

import torch

from engine.llm_engine import LLMEngine
from engine.scoring import greedy_batch


def greedy_tokens(engine: LLMEngine, prompts: tuple[int, ...], new: int, seed: int = 7
                  ) -> dict[str, list[int]]:
    """Request ``r{i}``: ``prompts[i]`` random token ids, ``new`` greedy tokens (EOS ignored),
    all in the engine at once; -> the tokens of each request."""
    g = torch.Generator().manual_seed(seed)
    return greedy_batch(engine, [torch.randint(2, 97, (n,), generator=g).tolist()
                                 for n in prompts], new)
