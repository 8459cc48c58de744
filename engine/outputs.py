"""What the engine reports: a request's output of one step, and the engine's counters (plain
data the workers turn into gRPC messages; ``engine.llm_engine`` re-exports both)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_imported_tokens: int
    num_output_tokens: int = 0
    # one per new token, when the request asked for logprobs (engine.sampler.TokenLogprobs)
    logprobs: list[Any] | None = None
    # on the first output of a request with prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[Any] | None = None
    # on the finishing output: arrival to admission, admission to the first token (seconds)
    queue_time_s: float = 0.0
    prefill_time_s: float = 0.0
    # set when finish_reason is "error": why this sequence alone was ended (a typed engine
    # error, engine.errors.SequenceFailed, that the worker maps to its RPC status)
    error: Exception | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    free_kv_tokens: int
    steps_completed: int
    tokens_advanced: int
    num_preemptions: int
    device_allocs_since_warmup: int | None
    # speculative decoding (vLLM's spec_decode counters): verify steps' drafts per sequence,
    # draft tokens, accepted ones, and accepted ones by position (index i: the (i+1)-th draft)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


def request_output(seq: Sequence, new: list[int], finished: bool,
                   reason: str | None) -> RequestOutput:
    """``seq``'s output of one step; a finishing one carries its queue and prefill times."""
    out = RequestOutput(seq.request_id, new, finished, reason, seq.num_prompt_tokens,
                        seq.num_cached_tokens, seq.num_imported_tokens,
                        len(seq.output_token_ids))
    if finished:
        admitted = seq.admitted_s if seq.admitted_s is not None else time.monotonic()
        out.queue_time_s = max(admitted - seq.added_s, 0.0)
        if seq.first_token_s is not None:
            out.prefill_time_s = max(seq.first_token_s - admitted, 0.0)
    return out
