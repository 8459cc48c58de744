"""IncrementalDetokenizer and find_stop (common/detokenizer.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common.detokenizer import IncrementalDetokenizer, SpacedSpecials, find_stop
from common.tokenizer import Tokenizer

STREAM_TEXTS = [
    "Hello world, this is a stream.",
    "naïve café — ünïcödé ☃ 日本語のテキスト 한국어 Ελληνικά",
    "emoji 🤖👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷 end",
    "  leading spaces\n\n  and indented lines\tand tabs",
    "<|im_start|>assistant\nThe answer is 4.<|im_end|>",
]


@pytest.fixture(scope="module", params=["gguf", "sentencepiece"])
def tokenizer(request, smollm2_tokenizer: Tokenizer, sentencepiece_folder: Path) -> Tokenizer:
    if request.param == "gguf":
        return smollm2_tokenizer
    return Tokenizer.from_path(sentencepiece_folder)


def _stream(
    tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode_and_never_splits_a_character(tokenizer, skip):
    rng = random.Random(0)
    prompt = tokenizer.encode("Previous turn: ", add_special_tokens=False)
    for text in STREAM_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for chunking in ("one", "random"):
            chunks = [1] * len(ids)
            if chunking == "random":
                chunks = []
                while sum(chunks) < len(ids):
                    chunks.append(rng.randint(1, 3))
            deltas = _stream(tokenizer, prompt, ids, chunks, skip)
            # The stream continues the prompt: decode(prompt + ids) = decode(prompt) + stream.
            full = tokenizer.decode(prompt + ids, skip)
            assert full == tokenizer.decode(prompt, skip) + "".join(deltas), (text, deltas)
            assert not any("\ufffd" in d for d in deltas), (text, deltas)


def test_multibyte_character_is_held_until_complete(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1  # a byte-level vocabulary splits this emoji over several tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🤖"
    # An incomplete character at the end of the stream comes out (as U+FFFD) on flush only.
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_find_stop_basics():
    assert find_stop("Hello world", ["wor"]).stop_index == 6
    m = find_stop("abc STOP def END", ["END", "STOP"])
    assert (m.stop_index, m.stop_string, m.safe_len) == (4, "STOP", 4)
    m = find_stop("The answer is 4. ###", ["### END"])
    assert m.stop_index is None and m.safe_len == len("The answer is 4. ")  # "###" may begin it
    m = find_stop("text with no stop", ["zz", ""])
    assert m.stop_index is None and m.safe_len == len("text with no stop")
    assert find_stop("anything", []).safe_len == len("anything")


def test_find_stop_incremental_equals_full_search():
    rng = random.Random(1)
    alphabet = "ab c"
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
        text, found = "", None
        while len(text) < 30 and found is None:
            new = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            text += new
            inc = find_stop(text, stops, num_new_chars=len(new))
            full = find_stop(text, stops)
            assert inc == full, (text, stops)
            found = inc.stop_index
        if found is not None:
            first = min(i for i in (text.find(s) for s in stops) if i != -1)
            assert found == first


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_spaces_between_special_tokens_streamed(tokenizer: Tokenizer, chunk: int) -> None:
    """vLLM's spaces_between_special_tokens: two kept special tokens side by side get one space
    between them, streamed or not; the text around them is decoded as it is without it."""
    text = "Hi<|im_end|><|im_start|>assistant\nok<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.backend.token_to_id("<|im_end|>") not in tokenizer.special_token_ids:
        pytest.skip("this tokenizer has no <|im_end|> special token")
    spaced = SpacedSpecials(tokenizer, tokenizer.special_token_ids)
    want = "Hi<|im_end|> <|im_start|>assistant\nok<|im_end|>"
    assert spaced.decode(ids, False) == want
    assert spaced.decode(ids, True) == tokenizer.decode(ids, True)
    detok = IncrementalDetokenizer(spaced, [], skip_special_tokens=False)
    out = "".join(detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
    assert out + detok.flush() == want
