"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens, for speculative decoding (engine/spec_decode.py verifies them).

Host-side only and allocation-free in steady state: each cache slot has a preallocated row of
``max_context`` token ids (int32) that is extended by the tokens a step appended, and one search
scratch row; a proposal runs a few vectorised compares into that scratch. It never touches the
device and never sizes anything by what a request asks for.
"""

from __future__ import annotations

import numpy as np

from engine.sequence import Sequence

# Longest and shortest suffix looked up (vLLM's prompt_lookup_max / prompt_lookup_min): a longer
# match is tried first, as it predicts the continuation better.
PROMPT_LOOKUP_MAX = 4
PROMPT_LOOKUP_MIN = 2


class NgramDrafter:
    """Per-slot token history and the n-gram lookup over it."""

    def __init__(self, max_batch: int, max_context: int) -> None:
        self.history = np.zeros((max_batch, max_context), dtype=np.int32)
        self.lengths = np.zeros(max_batch, dtype=np.int64)
        self._match = np.zeros(max_context, dtype=np.bool_)
        self._cmp = np.zeros(max_context, dtype=np.bool_)

    def reset(self, slot: int) -> None:
        """A new sequence took ``slot``: its history starts empty (``sync`` fills it)."""
        self.lengths[slot] = 0

    def sync(self, slot: int, seq: Sequence) -> None:
        """Append the tokens ``seq`` gained since the last sync (a step's accepted tokens)."""
        have, now = int(self.lengths[slot]), seq.num_tokens
        if now > have:
            self.history[slot, have:now] = seq.token_slice(have, now)
            self.lengths[slot] = now

    def propose(self, slot: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens for the sequence in ``slot`` (none when no suffix of
        ``PROMPT_LOOKUP_MIN``..``PROMPT_LOOKUP_MAX`` tokens occurred before)."""
        n_tokens = int(self.lengths[slot])
        hist = self.history[slot]
        if k <= 0:
            return []
        for n in range(min(PROMPT_LOOKUP_MAX, n_tokens - 1), PROMPT_LOOKUP_MIN - 1, -1):
            # start positions i of earlier windows hist[i:i+n] that leave >= 1 token after them
            width = n_tokens - n
            match, cmp = self._match[:width], self._cmp[:width]
            suffix = hist[n_tokens - n:n_tokens]
            np.equal(hist[0:width], suffix[0], out=match)
            for t in range(1, n):
                np.equal(hist[t:width + t], suffix[t], out=cmp)
                np.logical_and(match, cmp, out=match)
            last = width - 1 - int(match[::-1].argmax())  # the latest match
            if match[last]:
                start = last + n
                end = min(start + k, n_tokens)
                return hist[start:end].tolist()
        return []
