"""Greedy tokens of one request run to its end on an in-process engine (a test's reference)."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def engine_greedy(engine: LLMEngine, prompt: list[int], max_tokens: int,
                  request_id: str = "ref") -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                          ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    return out
