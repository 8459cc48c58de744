"""Streaming text for generated tokens: an incremental detokenizer that never emits half a
multi-byte character, and stop-string matching that knows what may still become a stop string.

Works with any object that has ``decode(ids, skip_special_tokens)`` (common/tokenizer.Tokenizer).
Torch-free; it never encodes and never decides when a request finishes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class SpacedSpecials:
    """A decoder that writes one space between two adjacent special tokens it keeps (vLLM's
    ``spaces_between_special_tokens``): ``<|im_end|> <|im_start|>``. Text around a special
    token is left as the tokenizer decodes it, so nothing else changes."""

    def __init__(self, tokenizer: Decoder, special_token_ids: Collection[int]) -> None:
        self._tok = tokenizer
        self._special = frozenset(special_token_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens or not self._special:
            return self._tok.decode(ids, skip_special_tokens)
        pieces: list[str] = []
        start = 0
        for i in range(1, len(ids)):
            if ids[i] in self._special and ids[i - 1] in self._special:
                pieces.append(self._tok.decode(ids[start:i], False))
                start = i
        pieces.append(self._tok.decode(ids[start:], False))
        return " ".join(pieces)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas. A delta is only released once the window
    decodes without a trailing U+FFFD, so a multi-byte character split over tokens is never
    emitted half. Decodes a short window, not the whole output, per step."""

    _CONTEXT = 6  # prompt tokens kept so the first token decodes with its real neighbourhood

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._CONTEXT :])
        self._prefix = 0  # start of the window already turned into text
        self._read = len(self._ids)  # end of the part that has been emitted
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds ids, returns the new text that is safe to show (possibly empty)."""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: whatever is held back (an incomplete character becomes U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        window = self._tok.decode(self._ids[self._prefix :], self._skip)
        if not final and (window.endswith("\ufffd") or len(window) <= len(before)):
            return ""
        delta = window[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta


@dataclass(frozen=True)
class StopMatch:
    """Result of scanning generated text for stop strings."""

    stop_index: int | None  # where the output ends (start of the matched stop string), or None
    stop_string: str | None
    safe_len: int  # chars of text that may be streamed now (held back: a possible stop's prefix)


def find_stop(
    text: str, stop_strings: Sequence[str], num_new_chars: int | None = None
) -> StopMatch:
    """Earliest stop string in ``text``; only the tail that ``num_new_chars`` could have
    completed is searched (pass None to search all). The output excludes the stop string."""
    stops = [s for s in stop_strings if s]
    if not stops:
        return StopMatch(None, None, len(text))
    longest = max(len(s) for s in stops)
    start = 0 if num_new_chars is None else max(0, len(text) - num_new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        return StopMatch(best[0], best[1], best[0])
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return StopMatch(None, None, len(text) - hold)
