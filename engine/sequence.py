"""The scheduler's view of one request: token ids and counters, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: int  # admission order; preemption evicts the latest arrival first
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is written
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache or imported
    num_imported_tokens: int = 0  # of those, loaded by kv_import
    cache_slot: int = -1  # index in [0, max_batch) while running (sampling generator, carry)
    is_fresh: bool = False  # admitted, no chunk scheduled yet
    finish_reason: str | None = None
    keep_kv: bool = False
    num_preemptions: int = 0
    # time.monotonic() at add_request, at the first admission and at the first token computed
    # here (the request's queue and prefill times, vLLM's request_queue/prefill_time_seconds)
    added_s: float = 0.0
    admitted_s: float | None = None
    first_token_s: float | None = None
    has_kv_import: bool = False
    # admitted with its blocks, its KV being imported over steps: no chunk until it is all in
    is_importing: bool = False
    seed: int = 0  # sampling seed, fixed at arrival
    rng_state: Any = None  # the generator's state when preempted, restored on re-admission
    # Set when output token 0 was sampled elsewhere (prefill worker); counts towards max_tokens.
    external_first_token: bool = False
    grammar: Any = None  # a compiled xgrammar grammar the output must follow (None: free)
    matcher: Any = None  # its matcher, made at admission (engine/grammar.py)
    # sampling.prompt_logprobs set: prompt token i's TokenLogprobs at index i (0 stays None),
    # filled chunk by chunk (a recomputed chunk overwrites) and handed out with the first output
    prompt_logprobs: list[Any] | None = None
    # speculative decoding: the drafts proposed for this step (set by the engine before each
    # schedule) and how many of them the scheduler put into this step's chunk
    draft_token_ids: list[int] = field(default_factory=list)
    num_scheduled_drafts: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    # Hashes of this sequence's full, computed blocks, in order (the prefix-cache chain); grown
    # incrementally so a step never rehashes the whole context.
    block_hashes: list[bytes] = field(default_factory=list)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (a step must not cost O(context))."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
