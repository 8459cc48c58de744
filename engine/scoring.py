"""Scoring a prompt through the serving path: the logits at its last position, computed by the
same chunked steps a served request takes (tests compare them with a reference model; the lab
scores drafts with them). Not on any serving path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def final_logits(engine: LLMEngine, prompt_token_ids: Sequence[int],
                 request_id: str = "score") -> torch.Tensor:
    """Logits [vocab] fp32 at the prompt's last position. Runs the engine until the request is
    done."""
    runner = engine.runner
    runner.capture_logits.add(request_id)
    try:
        engine.add_request(request_id, prompt_token_ids,
                           SamplingParams(max_tokens=1, temperature=0.0))
        while request_id not in runner.captured_logits:
            if not engine.step() and not engine.has_unfinished():
                raise RuntimeError(f"{request_id} finished without logits")
        return runner.captured_logits.pop(request_id)
    finally:
        runner.capture_logits.discard(request_id)


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    """Step the engine until every request has finished; -> each request's output tokens."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def greedy_batch(engine: LLMEngine, prompts: Sequence[Sequence[int]], max_tokens: int,
                 prefix: str = "r") -> dict[str, list[int]]:
    """Request ``{prefix}{i}`` for each prompt, all in the engine at once, ``max_tokens``
    greedy tokens each (EOS ignored); -> the tokens of each request."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", list(p), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return drain(engine)
