"""GGUF tokenizers beyond the default file: the SmolLM2 vocabulary re-written with other
``tokenizer.ggml.pre`` split rules (Llama 3, Qwen2), BOS added, user-defined tokens and an EOT id;
ours must encode exactly as transformers' AutoTokenizer reads each file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from common.gguf_metadata import read_gguf_header
from common.tokenizer import Tokenizer
from tests.common.test_tokenizer import TEXTS

EXTRA = [
    "Numbers: 1234567 and 89, mixed a1b22c333",
    "Contractions: DON'T I'LL we'D",
    "(parenthesised words) [brackets] {braces} path/to/file.py",
    "Line one\r\nLine two\n\n\n   spaced\t\ttabs",
]


def _variant(src: Path, dst: Path, pre: str, add_bos: bool, user_defined: list[int]) -> None:
    md = read_gguf_header(src).metadata
    types = list(md["tokenizer.ggml.token_type"])
    for i in user_defined:
        types[i] = int(gguf.TokenType.USER_DEFINED)
    writer = gguf.GGUFWriter(str(dst), arch="llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(md["tokenizer.ggml.tokens"])
    writer.add_token_types(types)
    writer.add_token_merges(md["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(md["tokenizer.chat_template"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _glued(tok: Tokenizer, i: int) -> str:
    return f"zq{tok.decode([i])}qz"


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", True), ("qwen2", False)])
def test_variant_encodes_like_transformers(smollm2_gguf, smollm2_tokenizer, tmp_path, pre, add_bos):
    from transformers import AutoTokenizer

    # Make two vocabulary entries user-defined added tokens (like Qwen's <think>): ones that plain
    # BPE would not produce inside a glued word, so matching them whole is visible.
    # (Alphanumeric ones: transformers matches an added token by its byte-level spelling.)
    user_defined = [
        i
        for i in range(1000, 3000)
        if smollm2_tokenizer.decode([i]).isalnum()
        and i not in smollm2_tokenizer.encode(_glued(smollm2_tokenizer, i))
    ][:2]
    assert len(user_defined) == 2
    path = tmp_path / f"tok-{pre}.gguf"
    _variant(smollm2_gguf, path, pre, add_bos, user_defined)
    ours = Tokenizer.from_path(path)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    glued = [_glued(smollm2_tokenizer, i) for i in user_defined]
    for text in [*TEXTS, *EXTRA, *glued]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), (pre, text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), (pre, text)
    for i, text in zip(user_defined, glued, strict=True):
        assert i in ours.encode(text)
    # The split rule is really applied: it changes some encodings against the default file.
    assert any(ours.encode(t, False) != smollm2_tokenizer.encode(t, False) for t in EXTRA)
    assert (ours.encode("hi")[:1] == [1]) == add_bos
    assert ours.eos_token_ids == (2, 0)  # eos, then eot
