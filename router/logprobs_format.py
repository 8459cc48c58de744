"""Token logprobs from the workers (``router.worker_codec.TokenLogprobs``) as OpenAI's two shapes: chat's
``{"content": [{token, logprob, bytes, top_logprobs}]}`` and completions' ``{tokens,
token_logprobs, top_logprobs, text_offset}``.

The values are the log-softmax of the logits after penalties and logit bias and before
temperature / top-k / top-p / min-p (the engine's sampler says why). Token strings are each
token decoded on its own, special tokens included. Pure formatting: never awaits, never reaches
a worker, never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.detokenizer import Decoder
from router.worker_codec import TokenLogprobs


@dataclass(frozen=True)
class LogprobEntry:
    """One token: its text, logprob, and the top alternatives (text, logprob). A prompt's first
    token has neither (None): nothing comes before it to score it."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] | None


def token_text(tokenizer: Decoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def entries(tokenizer: Decoder, logprobs: Sequence[TokenLogprobs]) -> list[LogprobEntry]:
    return [LogprobEntry(token_text(tokenizer, lp.token_id), float(lp.logprob),
                         tuple((token_text(tokenizer, t), float(v))
                               for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)))
            for lp in logprobs]


def _item(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(items: Sequence[LogprobEntry]) -> dict[str, Any]:
    return {"content": [{**_item(e.token, e.logprob),
                         "top_logprobs": [_item(t, v) for t, v in e.top or ()]} for e in items],
            "refusal": None}


def _by_text(top: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Completions key alternatives by text; tokens that decode alike (byte pieces of one
    character) keep the most likely one's logprob."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token, logprob)
    return out


def completion_logprobs(items: Sequence[LogprobEntry], text_offset: int) -> dict[str, Any]:
    """``text_offset``: where the first token's text starts in the choice's text."""
    offsets = []
    for e in items:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in items],
            "token_logprobs": [e.logprob for e in items],
            "top_logprobs": [None if e.top is None else _by_text(e.top) for e in items],
            "text_offset": offsets}
