"""The checks a request passes before the engine queues it, against the engine's configuration
and the model's vocabulary: each refusal names the field and the limit (engine/errors.py).

Plain data in, a typed error out; never looks at the engine's state (duplicates and the queue's
length are the engine's own checks).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import ContextLengthExceeded, InvalidRequest
from engine.sampling_params import SamplingParams


def check_request(ec: EngineConfig, vocab_size: int, prompt: list[int],
                  sampling: SamplingParams) -> None:
    """Raise InvalidRequest / ContextLengthExceeded if ``prompt`` with ``sampling`` cannot run
    on an engine of ``ec``."""
    if not prompt:
        raise InvalidRequest("the prompt is empty: at least one token is needed", "prompt")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                             "prompt")
    bad_bias = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
    if bad_bias is not None:
        raise InvalidRequest(f"logit_bias: token id {bad_bias} is outside the vocabulary "
                             f"[0, {vocab_size})", "logit_bias")
    if len(prompt) + sampling.max_tokens > ec.max_context:
        raise ContextLengthExceeded(len(prompt), sampling.max_tokens, ec.max_context)
    wanted = sampling.num_speculative_tokens
    if wanted is not None and wanted > ec.spec_tokens:
        raise InvalidRequest(
            f"num_speculative_tokens={wanted} is above this worker's limit of "
            f"{ec.spec_tokens} (speculative_method={ec.speculative_method}"
            + (f", num_speculative_tokens={ec.num_speculative_tokens}"
               if ec.spec_tokens else "") + ")", "num_speculative_tokens")
