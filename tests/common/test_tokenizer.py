"""common/tokenizer.py encodes, decodes and renders chats exactly as transformers' AutoTokenizer
on the same files: the default GGUF, the HF folder transformers writes from it, and a
sentencepiece-style (Metaspace + byte fallback) folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from common.tokenizer import Tokenizer, TokenizerError
from tests.common.conftest import SENTENCES

TEXTS = [
    *SENTENCES,
    "",
    " ",
    "   leading spaces",
    "trailing space ",
    "naïve café — ünïcödé ☃ Ελληνικά русский 日本語のテキスト 한국어",
    "emoji 🤖👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>a/b<filename>x.py\n",
    "not special: <|im_start without end, <im_end|>",
    "tabs\tand\nnewlines\r\n\n   indented code:\n    return x  # comment",
    "numbers 1234567890 3.14159 1e-5 0x1F",
    "don't I'm we've they're It's",
    "\u00a0non-breaking\u2003em space\u200bzero width",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Héllo 🤖"},
        {"role": "assistant", "content": "Hi.", "tool_calls": None},
        {"role": "user", "content": "  spaces  "},
    ],
]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_tokenizer: Tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_gguf_encode_decode_equal_transformers(
    gguf_tokenizer, reference_tokenizer, add_special_tokens
):
    for text in TEXTS:
        ids = gguf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference_tokenizer.encode(text, add_special_tokens=add_special_tokens), text
        for skip in (True, False):
            assert gguf_tokenizer.decode(
                ids, skip_special_tokens=skip
            ) == reference_tokenizer.decode(ids, skip_special_tokens=skip), (text, skip)
    # Special tokens are single ids, and skipping them in decode drops them.
    ids = gguf_tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert gguf_tokenizer.decode(ids) == "hi"


def test_gguf_chat_template_and_ids(gguf_tokenizer, reference_tokenizer):
    for messages in MESSAGES:
        for gen in (True, False):
            ours = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = reference_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            assert ours == theirs
    prompt = gguf_tokenizer.apply_chat_template(MESSAGES[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert gguf_tokenizer.encode(
        prompt, add_special_tokens=False
    ) == reference_tokenizer.apply_chat_template(
        MESSAGES[0], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert gguf_tokenizer.bos_token_id == reference_tokenizer.bos_token_id == 1
    assert gguf_tokenizer.eos_token_ids == (reference_tokenizer.eos_token_id,) == (2,)
    assert gguf_tokenizer.vocab_size == len(reference_tokenizer) == 49152


def test_hf_folder_written_by_transformers(
    smollm2_hf_tokenizer_folder, reference_tokenizer, gguf_tokenizer
):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2_hf_tokenizer_folder)
    tok = Tokenizer.from_path(smollm2_hf_tokenizer_folder)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.encode(text) == reference_tokenizer.encode(text), text
    for messages in MESSAGES:
        assert tok.apply_chat_template(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert tok.eos_token_ids == (2, 0)  # tokenizer's eos first, then generation_config's
    assert tok.fingerprint == gguf_tokenizer.fingerprint  # same vocab, merges and specials


def test_sentencepiece_folder_equal_transformers(sentencepiece_folder):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(sentencepiece_folder)
    tok = Tokenizer.from_path(sentencepiece_folder)
    for text in [*TEXTS, "<s>inline</s> specials"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert ids[:1] == [tok.bos_token_id]  # from tokenizer.json's post-processor
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, False) == ref.decode(ids, skip_special_tokens=False), text
    tools = [{"type": "function", "function": {"name": "f", "description": "ü"}}]
    messages = [
        {"role": "user", "content": " hi ", "tool_calls": None},
        {
            "role": "assistant",
            "content": "yo",
            "tool_calls": [{"name": "f", "arguments": {"x": "é"}}],
        },
    ]
    ours = tok.apply_chat_template(messages, tools=tools)
    assert ours == ref.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert '"é"' in ours and "TOOLS" in ours  # tojson does not escape to \\u00e9


def test_truncation_and_padding_in_tokenizer_json_are_ignored(sentencepiece_folder, tmp_path):
    from transformers import AutoTokenizer

    state = json.loads((sentencepiece_folder / "tokenizer.json").read_text())
    state["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(state))
    (tmp_path / "tokenizer_config.json").write_text(
        (sentencepiece_folder / "tokenizer_config.json").read_text()
    )
    ids = Tokenizer.from_path(tmp_path).encode(SENTENCES[0])
    assert len(ids) > 4
    assert ids == AutoTokenizer.from_pretrained(tmp_path).encode(SENTENCES[0])


def test_fingerprint_changes_with_vocab(sentencepiece_folder, tmp_path):
    tok = Tokenizer.from_path(sentencepiece_folder)
    state = json.loads((sentencepiece_folder / "tokenizer.json").read_text())
    vocab = state["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "tokenizer.json").write_text(json.dumps(state))
    (tmp_path / "tokenizer_config.json").write_text(
        (sentencepiece_folder / "tokenizer_config.json").read_text()
    )
    other = Tokenizer.from_path(tmp_path)
    assert other.fingerprint != tok.fingerprint
    assert tok.fingerprint == Tokenizer.from_path(sentencepiece_folder).fingerprint


def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_path(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor a .gguf"):
        Tokenizer.from_path(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_path(tmp_path)


def test_tokenizer_module_does_not_import_torch():
    import subprocess

    code = (
        "import sys; from common.tokenizer import Tokenizer; import common.chat_template, "
        "common.default_model, common.detokenizer, common.gguf_metadata; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
