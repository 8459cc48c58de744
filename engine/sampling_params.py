"""Per-request sampling parameters, validated at construction so a bad value is refused before it
reaches the device.

The per-slot buffers that carry these to the device (``engine/slot_sampling.py``) are sized by the
limits here (``MAX_LOGIT_BIAS``, ``MAX_STOP_TOKEN_IDS``, ``MAX_LOGPROBS``): a request past one is
refused naming the field, never given a bigger buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequest

MAX_LOGIT_BIAS = 300  # entries of logit_bias a request may carry (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64  # stop token ids (user's + EOS) that min_tokens can hold back
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
MAX_PROMPT_LOGPROBS = 5  # top alternatives per prompt token (OpenAI's completions limit)
# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): logits divided by 1e-45
# overflow to inf and the softmax turns NaN, so a tiny temperature means "argmax" here.
GREEDY_TEMPERATURE_FLOOR = 1e-5
# The repetition penalty divides positive logits by r: below this, 1/r leaves float32's range.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE_FLOOR (0 included) -> greedy
    top_p: float = 1.0  # 1 -> off
    top_k: int = 0  # 0 -> off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: divides (>0) or multiplies (<0) seen tokens' logits
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    min_tokens: int = 0  # stop tokens and EOS are masked until this many tokens are out
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k
    # None: none; k >= 0: every prompt token's logprob (the first has none) and the top k
    # (engine/prompt_logprobs.py); with it, max_tokens may be 0 (score the prompt, generate nothing)
    prompt_logprobs: int | None = None
    # speculative decoding: most draft tokens verified per step for this request; None: the
    # worker's num_speculative_tokens, 0: none (at most the worker's, checked by the engine)
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise InvalidRequest(f"num_speculative_tokens must be >= 0, got "
                                 f"{self.num_speculative_tokens}", "num_speculative_tokens")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}], got "
                                 f"{self.prompt_logprobs}", "prompt_logprobs")
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens < least:
            raise InvalidRequest(f"max_tokens must be >= {least}"
                                 + ("" if least == 0 else " (0 only with prompt logprobs)")
                                 + f", got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(
                f"temperature must be in [0, 100], got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10.0:
            raise InvalidRequest(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10], got "
                                 f"{self.repetition_penalty}", "repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                                 f"{self.min_tokens}", "min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries, the limit is "
                                 f"{MAX_LOGIT_BIAS}", "logit_bias")
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequest(f"logit_bias: token id {token} is negative", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequest(f"logit_bias: the bias of token {token} must be in "
                                     f"[-100, 100], got {bias}", "logit_bias")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids, the limit "
                                 f"is {MAX_STOP_TOKEN_IDS}", "stop_token_ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
                                 "logprobs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_FLOOR or self.top_k == 1

    @property
    def uses_counts(self) -> bool:
        """The sampler needs this sequence's token counts (a penalty is on)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_processors(self) -> bool:
        """Some logits processing beyond temperature / top-k / top-p is on."""
        return self.uses_counts or bool(self.logit_bias) or self.min_tokens > 0
