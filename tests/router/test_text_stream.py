"""Incremental detokenization with stop strings, against decoding the whole output at once."""

from __future__ import annotations

import pytest

from router.text_stream import TextOptions, TextStream
from tests.router.router_fakes import TinyTokenizer

TEXTS = [" The answer is 42. END of the story, ça va?", "Bonjour à tous, ça va? 日本語 ✓ ok",
         "Hello world! The quick brown fox"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_text_equals_full_decode(tok: TinyTokenizer, text: str, chunk: int) -> None:
    prompt = tok.encode("Hello world!", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    ts = TextStream(tok, prompt)
    parts = [ts.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(ts.finish())
    assert "".join(parts) == tok.decode(ids) == text
    # no part ever ends inside a multi-byte character
    assert all("\ufffd" not in p for p in parts)


def _first_cut(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if text.find(s) >= 0]
    return text[:min(hits)] if hits else text


@pytest.mark.parametrize("stops", [["END"], [" story", "42"], ["ça"], ["nothing-like-this"],
                                   ["va?"], ["The answer is 42. END of the story, ça va"]])
def test_stop_strings_cut_text_across_token_boundaries(tok: TinyTokenizer,
                                                       stops: list[str]) -> None:
    text = TEXTS[0]
    ids = tok.encode(text, add_special_tokens=False)
    ts = TextStream(tok, [], stops)
    out = ""
    consumed = 0
    for tid in ids:
        out += ts.add([tid])
        consumed += 1
        if ts.stopped:
            break
    if not ts.stopped:
        out += ts.finish()
    expected = _first_cut(text, stops)
    assert out == expected == ts.text
    assert ts.stopped == (expected != text)
    if ts.stopped:   # stopped at the token that completed the stop string, not later
        assert any(s in tok.decode(ids[:consumed]) for s in stops)
        assert not any(s in tok.decode(ids[:consumed - 1]) for s in stops)


def test_held_back_text_is_never_more_than_a_stop_prefix(tok: TinyTokenizer) -> None:
    ids = tok.encode(TEXTS[1] * 3, add_special_tokens=False)
    ts = TextStream(tok, [], ["zzzz"])
    sent = ""
    for tid in ids:
        sent += ts.add([tid])
    assert len(tok.decode(ids)) - len(sent) <= 1   # "zzzz" never starts: nothing held but a partial char
    assert sent + ts.finish() == tok.decode(ids)


def test_default_model_tokenizer_round_trip() -> None:
    """The real SmolLM2 tokenizer (GGUF), streamed one token at a time, with a stop string."""
    from common.default_model import DefaultModelMissing, default_model_path
    from common.tokenizer import Tokenizer

    try:
        real = Tokenizer.from_path(default_model_path())
    except DefaultModelMissing as exc:
        pytest.skip(str(exc))
    text = "Paris is the capital of France. Café, naïve — 日本語 ✓ done."
    ids = real.encode(text, add_special_tokens=False)
    prompt = real.encode("What is the capital of France?", add_special_tokens=False)
    ts = TextStream(real, prompt)
    assert "".join(ts.add([t]) for t in ids) + ts.finish() == real.decode(ids) == text
    ts = TextStream(real, prompt, ["日本"])
    out = ""
    for t in ids:
        out += ts.add([t])
    assert ts.stopped and out == text[:text.index("日本")]


@pytest.mark.parametrize("chunk", [1, 3])
def test_include_stop_str_in_output_keeps_the_stop_string(tok: TinyTokenizer, chunk: int) -> None:
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    for keep, want in ((False, " The answer is "), (True, " The answer is 42")):
        ts = TextStream(tok, [], ["42"], TextOptions(include_stop_str_in_output=keep))
        out = "".join(ts.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
        assert out + ts.finish() == want and ts.stopped


def test_skip_special_tokens_false_keeps_them(tok: TinyTokenizer) -> None:
    ids = tok.encode("Hi<|im_end|><|im_start|> there", add_special_tokens=False)
    specials = {tok.encode(s, add_special_tokens=False)[0] for s in ("<|im_end|>", "<|im_start|>")}

    def text(**kw: bool) -> str:
        ts = TextStream(tok, [], (), TextOptions(**kw), specials)
        return ts.add(ids) + ts.finish()

    assert text() == "Hi there"
    assert text(skip_special_tokens=False) == "Hi<|im_end|> <|im_start|> there"
    assert text(skip_special_tokens=False,
                spaces_between_special_tokens=False) == "Hi<|im_end|><|im_start|> there"
