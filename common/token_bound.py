"""A sound lower bound on how many tokens a text encodes to, computed from its length alone.

Tokenizing a 50 MB prompt takes seconds of CPU; refusing it because it is over the context only
after that is how one request stalls everyone.  If no token of a vocabulary covers more than
``L`` bytes of input, a text of ``B`` UTF-8 bytes needs at least ``ceil(B / L)`` tokens, so a
prompt whose bound is already over the context can be refused before it is tokenized.

The bound only holds when the pipeline neither drops nor shrinks input (a normalizer that
removes characters, a pre-tokenizer that discards whitespace, a model that fuses runs of unknown
characters into one token); for those ``max_token_bytes`` answers None and the caller must not
pre-check.  Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) and SentencePiece-style BPE with
byte fallback qualify.  This module must never import torch or tokenize anything.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as Backend

# pre-tokenizers that keep every input byte in some piece (Split keeps them unless "Removed")
_KEEPING_PRE = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split",
                          "UnicodeScripts"})


def _normalizer_keeps_length(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_length(s) for s in spec.get("normalizers", []))
    if kind == "Prepend":
        return True
    if kind == "Replace":   # "▁" for " " grows the text; a replacement by less could shrink it
        pattern = spec.get("pattern", {}).get("String")
        content = spec.get("content", "")
        return isinstance(pattern, str) and len(content.encode()) >= len(pattern.encode())
    return False   # NFC/NFKC compose, Strip/Lowercase may shrink, BertNormalizer drops controls


def _pre_tokenizer_keeps_bytes(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_bytes(s) for s in spec.get("pretokenizers", []))
    if kind == "Split" and spec.get("behavior") == "Removed":
        return False
    return kind in _KEEPING_PRE


def _model_keeps_bytes(spec: dict[str, Any]) -> bool:
    if spec.get("type") != "BPE":
        return False   # WordPiece/WordLevel/Unigram map an unknown word of any length to one id
    return not spec.get("fuse_unk") or bool(spec.get("byte_fallback"))


def max_token_bytes(backend: Backend) -> int | None:
    """The most UTF-8 bytes of input one token can stand for, or None when no sound bound holds.

    Vocabulary strings are measured in UTF-8 bytes, which over-counts byte-level symbols (each
    stands for one byte but takes two to spell) and SentencePiece's "▁": an over-estimate of L
    only makes the bound weaker, never wrong.  Added tokens (special tokens matched in text) are
    part of the vocabulary and counted too.
    """
    state = json.loads(backend.to_str())
    if not (_normalizer_keeps_length(state.get("normalizer"))
            and _pre_tokenizer_keeps_bytes(state.get("pre_tokenizer"))
            and _model_keeps_bytes(state.get("model", {}))):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0) or None


def min_tokens(text: str, max_bytes_per_token: int | None) -> int:
    """Fewest tokens ``text`` can encode to (0 when there is no bound)."""
    if not max_bytes_per_token:
        return 0
    num_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-num_bytes // max_bytes_per_token)
