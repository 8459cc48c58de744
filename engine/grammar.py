"""Constrained decoding in the engine: each constrained sequence holds an xgrammar matcher, and a
step's token bitmask (one bit per vocabulary entry, 32 to an int32 word) masks its logits.

The host side of the bitmask is one buffer of ``max_batch`` rows made at start-up (pinned on
CUDA); its device side is a workspace view taken per step (a ``ws.sampler`` share in the plan).
Grammars are compiled elsewhere, off the engine thread (``worker/grammar_cache.py``): this module
never compiles and never blocks on anything but the matcher's own bitmask fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.workspace import Workspace


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def bitmask_workspace_bytes(max_batch: int, vocab_size: int) -> int:
    """The packed mask, its bits unpacked to int32 and the boolean mask, for a full batch."""
    words = bitmask_words(vocab_size)
    return max_batch * (words * 4 + words * 32 * 4 + vocab_size) + 3 * 256


def new_matcher(compiled: Any, accepted: Sequence[int] = ()) -> Any:
    """A matcher at the start of ``compiled``, advanced over ``accepted`` tokens (a sequence
    readmitted after a preemption, or continuing from a token the prefill worker sampled)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for token in accepted:
        matcher.accept_token(int(token))
    return matcher


class TokenBitmask:
    """Fills the rows of constrained sequences and masks their logits."""

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.host = torch.full((max_batch, self.words), -1, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)

    def apply(self, logits: torch.Tensor, matchers: Sequence[Any | None],
              ws: Workspace) -> dict[int, str]:
        """Mask ``logits`` [n, vocab] fp32 in place: row i by ``matchers[i]``'s next-token
        bitmask, rows without a matcher not at all (their words are all ones). -> row: why,
        for the rows whose matcher cannot say what comes next (it has terminated, or raised):
        those rows are masked entirely, and only their sequences end."""
        n = logits.shape[0]
        failed: dict[int, str] = {}
        for i, m in enumerate(matchers):
            if m is None:
                self.host[i].fill_(-1)
                continue
            try:
                if m.is_terminated():
                    failed[i] = "its grammar is already complete: no token may follow"
                else:
                    m.fill_next_token_bitmask(self.host, i)
            except Exception as exc:  # noqa: BLE001 - a matcher's failure is its sequence's
                failed[i] = f"its grammar cannot give the next tokens ({exc})"
            if i in failed:
                self.host[i].fill_(0)
        dev = ws.take((n, self.words), torch.int32, caller="grammar.bitmask")
        dev.copy_(self.host[:n], non_blocking=True)
        apply_bitmask(logits, dev, self.shifts, ws)
        return {i: f"the sequence cannot continue: {why}" for i, why in failed.items()}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, shifts: torch.Tensor,
                  ws: Workspace) -> None:
    """logits [n, vocab] fp32, bitmask [n, ceil(vocab / 32)] int32 (bit j of word w allows
    token 32w + j, xgrammar's layout): disallowed logits become -inf, in place. Elementwise
    torch ops into workspace buffers, so it runs the same on every device and allocates
    nothing; ``shifts`` is arange(32) int32 on the logits' device."""
    n, vocab = logits.shape
    words = bitmask.shape[1]
    bits = ws.take((n, words, 32), torch.int32, caller="grammar.bits")
    torch.bitwise_right_shift(bitmask.unsqueeze(2), shifts, out=bits)
    bits.bitwise_and_(1)
    banned = ws.take((n, vocab), torch.bool, caller="grammar.banned")
    torch.eq(bits.view(n, words * 32)[:, :vocab], 0, out=banned)
    logits.masked_fill_(banned, float("-inf"))


def accepts(matcher: Any, token: int) -> bool:
    """Whether ``matcher`` took ``token``; a matcher that raises has not."""
    try:
        return bool(matcher.accept_token(int(token)))
    except Exception:  # noqa: BLE001 - xgrammar's errors end that sequence, not the step
        return False


def advance_matchers(matchers: dict[str, Any], sampled: dict[str, list[int]],
                     failed: dict[str, str]) -> set[str]:
    """Feed each constrained sequence's new tokens to its matcher. A token the matcher refuses
    (the mask allowed it: should never happen) ends that sequence, recorded in ``failed``; a
    grammar that completes cuts the sequence's tokens there. -> the sequences whose grammar
    took its last token in this step."""
    done = set()
    for rid, m in matchers.items():
        if rid in failed:
            continue
        for i, token in enumerate(sampled[rid]):
            if not accepts(m, token):
                failed[rid] = (f"the sequence cannot continue: its grammar refused token "
                               f"{token}, which it had allowed")
                break
            if m.is_terminated():
                done.add(rid)
                sampled[rid] = sampled[rid][: i + 1]
                break
    return done
