"""`bulkhead export-tokenizer` on the default GGUF: transformers loads the folder offline and
encodes, decodes and renders the chat template exactly as our tokenizer does."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.tokenizer import Tokenizer
from launch.cli import main as cli_main

TEXTS = ["Hello world!", "  leading spaces and émojis 🙂\nnew line", "<|im_start|>user\nhi"]


def test_export_loads_in_transformers(smollm2_gguf: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "tok"
    assert cli_main(["export-tokenizer", str(out), "--model", str(smollm2_gguf)]) == 0
    ours = Tokenizer.from_path(smollm2_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert theirs.encode(text, add_special_tokens=False) == ids
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(chat, add_generation_prompt=True)
    assert theirs.eos_token_id in ours.eos_token_ids
    # a second export refuses to overwrite
    assert cli_main(["export-tokenizer", str(out), "--model", str(smollm2_gguf)]) == 1
