"""Whether a decode worker fetches a prompt's KV from the store before it submits the request.

Plain data in, a verdict out: no store, no engine, no network, so it is tested on its own. The
fetch itself (and the engine hook that copies what it got) is worker/kv_import.py; the length of
the request is the engine's to refuse (ContextLengthExceeded), not decided again here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImportDecision:
    fetch: bool
    reason: str  # why not, for the log; "" when fetching


def decide_import(num_prompt_tokens: int, has_prefill: bool, handoff_layout: str,
                  num_tokens_stored: int, our_layout: str) -> ImportDecision:
    """Fetch unless the prompt is empty, the handoff's KV layout is not ours (its bytes would be
    read as garbage), or the prefill worker said it stored nothing (a fetch would only miss)."""
    if not num_prompt_tokens:
        return ImportDecision(False, "empty prompt")
    if has_prefill and handoff_layout and handoff_layout != our_layout:
        return ImportDecision(False, f"KV layout {handoff_layout} differs from ours "
                                     f"({our_layout}); recomputing the prompt")
    if has_prefill and num_tokens_stored == 0:
        return ImportDecision(False, "the prefill worker stored no KV")
    return ImportDecision(True, "")
