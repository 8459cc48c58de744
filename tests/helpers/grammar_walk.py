"""A character vocabulary for xgrammar and a random walk through a compiled grammar: a text the
grammar accepts, made without a model (tests of what a grammar allows, key order included)."""

from __future__ import annotations

import random
from typing import Any

STOP = "</s>"
VOCAB = [STOP] + [chr(c) for c in range(32, 127)] + ["\n", "｜", "▁", "é"]


def char_compiler() -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[0])
    return xgr.GrammarCompiler(info, max_threads=1)


def walk(compiled: Any, seed: int, prefix: str = "", favoured: str = '"}<]') -> str:
    """A text ``compiled`` accepts: at each step a random allowed character (``favoured`` ones
    forty times likelier, so the walk closes what it opens), until the end is allowed."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for ch in prefix:
        assert matcher.accept_token(VOCAB.index(ch)), (prefix, ch)
    rng = random.Random(seed)
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    out = prefix
    for _ in range(4000):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = [i for i in range(len(VOCAB)) if (int(bitmask[0, i // 32]) >> (i % 32)) & 1]
        if 0 in allowed:
            break
        weights = [40 if VOCAB[i] in favoured else 1 for i in allowed]
        token = rng.choices(allowed, weights)[0]
        assert matcher.accept_token(token)
        out += VOCAB[token]
    else:
        raise AssertionError("the walk did not finish")
    return out


def accepts(compiled: Any, text: str) -> bool:
    """Whether ``text`` (characters of VOCAB) is a whole answer of ``compiled``."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for ch in text:
        if ch not in VOCAB or not matcher.accept_token(VOCAB.index(ch)):
            return False
    return matcher.accept_token(0)
