"""Token ids -> text deltas for one choice, with stop strings cut out.

A thin layer over the shared `common.detokenizer.IncrementalDetokenizer` (never emits half a
multi-byte character) and `find_stop` (holds back a tail that could start a stop string).  When
a stop string appears the text is cut before it and `stopped` becomes True; nothing after it is
ever returned.  This module must never import torch and never send anything itself.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from common.detokenizer import Decoder, IncrementalDetokenizer, SpacedSpecials, find_stop

__all__ = ["Decoder", "TextOptions", "TextStream"]


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become text (vLLM's detokenization fields, with its defaults)."""

    skip_special_tokens: bool = True            # special tokens (EOS, <|im_end|>...) left out
    spaces_between_special_tokens: bool = True  # kept specials side by side get a space between
    include_stop_str_in_output: bool = False    # the matched stop string (or stop token) kept


class TextStream:
    """Incremental detokenizer with stop strings for one choice."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = (), options: TextOptions = TextOptions(),
                 special_token_ids: Collection[int] = ()) -> None:
        decoder: Decoder = tokenizer
        if not options.skip_special_tokens and options.spaces_between_special_tokens:
            decoder = SpacedSpecials(tokenizer, special_token_ids)
        self._detok = IncrementalDetokenizer(decoder, prompt_token_ids,
                                             skip_special_tokens=options.skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._keep_stop = options.include_stop_str_in_output
        self._text = ""          # decoded output so far (cut at a stop string once found)
        self._sent = 0           # characters of _text already returned
        self.stopped = False     # a stop string was found; no more text will come

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[:self._sent]

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text that can be sent now."""
        if self.stopped:
            return ""
        return self._release(self._detok.push([int(t) for t in token_ids]), final=False)

    def finish(self) -> str:
        """The stream ended: return whatever was held back (a dangling byte decodes as U+FFFD)."""
        if self.stopped:
            return ""
        return self._release(self._detok.flush(), final=True)

    def _release(self, new: str, final: bool) -> str:
        self._text += new
        match = find_stop(self._text, self._stop, len(new))
        if match.stop_index is not None:
            end = match.stop_index + (len(match.stop_string or "") if self._keep_stop else 0)
            cut = max(end, self._sent)
            out = self._text[self._sent:cut]
            self._text = self._text[:cut]
            self._sent = cut
            self.stopped = True
            return out
        end = len(self._text) if final else max(match.safe_len, self._sent)
        out = self._text[self._sent:end]
        self._sent = end
        return out
