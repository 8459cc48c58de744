"""The length bound on token counts is sound (never more than the real count) where it claims
to be, refuses to claim one where input can vanish, and tokenizing leaves the GIL free."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers, pre_tokenizers

from common.default_model import DefaultModelMissing, default_model_path
from common.token_bound import max_token_bytes, min_tokens
from common.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    try:
        return Tokenizer.from_path(default_model_path())
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))


def _texts(tok: Tokenizer) -> list[str]:
    rng = random.Random(7)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=lambda t: len(t.encode()))
    decoded_longest = tok.decode([vocab[longest]], skip_special_tokens=False)
    alphabet = "abc xyz 012 \n\t.,;éüß漢字😀\u200b<|>"
    out = ["", "a", " " * 5000, "\n" * 3000, decoded_longest * 200, "<|im_start|>" * 300,
           "😀" * 1000, "0123456789" * 500]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000)))
            for _ in range(30)]
    out += [" ".join(rng.choice(list(vocab)) for _ in range(400)) for _ in range(10)]
    return out


def test_the_bound_never_exceeds_the_real_count(smollm2: Tokenizer) -> None:
    bound = smollm2.max_token_bytes
    assert bound is not None and 1 < bound < 1000
    for text in _texts(smollm2):
        for special in (False, True):
            n = len(smollm2.encode(text, add_special_tokens=special))
            assert min_tokens(text, bound) <= n, (text[:60], n)


def test_the_bound_is_useful_on_long_prose(smollm2: Tokenizer) -> None:
    """Not vacuous: prose gets a bound within a small factor of its real count."""
    text = "The quick brown fox jumps over the lazy dog. " * 2000
    n = len(smollm2.encode(text))
    assert n / 40 < min_tokens(text, smollm2.max_token_bytes) <= n


@pytest.mark.parametrize("make", [
    lambda: _backend(normalizer=normalizers.NFKC()),            # "ﬁ" -> "fi" shrinks
    lambda: _backend(normalizer=normalizers.Strip()),           # drops whitespace
    lambda: _backend(pre=pre_tokenizers.Whitespace()),          # drops whitespace
    lambda: _backend(pre=pre_tokenizers.Split(" ", "removed")),
    lambda: Backend(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
    lambda: _backend(fuse_unk=True),                            # a run of unknowns -> one id
], ids=["nfkc", "strip", "whitespace", "split-removed", "wordpiece", "fuse-unk"])
def test_no_bound_where_input_can_vanish(make: Callable[[], Backend]) -> None:
    assert max_token_bytes(make()) is None


def test_bound_kept_for_growing_normalizers() -> None:
    spm = _backend(normalizer=normalizers.Sequence([normalizers.Prepend("▁"),
                                                    normalizers.Replace(" ", "▁")]))
    assert max_token_bytes(spm) == len(b"hello")
    assert max_token_bytes(_backend(normalizer=normalizers.Replace("ab", "c"))) is None


def test_no_bound_means_no_refusal() -> None:
    assert min_tokens("x" * 10_000, None) == 0


def _backend(normalizer: normalizers.Normalizer | None = None,
             pre: pre_tokenizers.PreTokenizer | None = None, fuse_unk: bool = False) -> Backend:
    b = Backend(models.BPE({"<unk>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "hello": 5},
                           [], unk_token="<unk>", fuse_unk=fuse_unk))
    if normalizer is not None:
        b.normalizer = normalizer
    if pre is not None:
        b.pre_tokenizer = pre
    return b


def _largest_tick_gap(work: Callable[[], object]) -> float:
    """Largest gap between 10 ms ticks of another Python thread while `work` runs here."""
    gaps = [0.0]
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        work()
    finally:
        done.set()
        ticker.join()
    return max(gaps)


def test_tokenizing_leaves_the_gil_to_other_threads(smollm2: Tokenizer) -> None:
    """The measured reason Tokenizer.encode goes through encode_batch: plain `encode` holds the
    GIL for the whole prompt, so tokenizing in a thread would still stop the router's event
    loop; encode_batch releases it (same ids).  tests/router/test_edge_limits.py measures the
    effect on running streams."""
    text = ("hello world, this is some text ünïcode 123. " * 25_000)[:1_000_000]
    held = _largest_tick_gap(lambda: smollm2.backend.encode(text, add_special_tokens=False))
    released = _largest_tick_gap(lambda: smollm2.encode(text, False))
    print(f"1 MB prompt: another thread waited up to {held:.3f} s with encode, "
          f"{released:.3f} s with encode_batch")
    assert smollm2.encode(text[:5000], False) == smollm2.backend.encode(
        text[:5000], add_special_tokens=False).ids
    assert released < held / 3
