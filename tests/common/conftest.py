"""Fixtures for common/ tests: the default GGUF, transformers' tokenizer for it (the reference),
an HF folder written by transformers from it, and a tiny sentencepiece-style tokenizer folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.tokenizer import Tokenizer

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Unicode: héllo, naïve café, 日本語, emoji 🤖.",
    "  two leading spaces and trailing  ",
    "numbers 12345 and symbols #$%&",
]



@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    """Our tokenizer on the default GGUF (~3 s: built once a session)."""
    return Tokenizer.from_path(smollm2_gguf)


@pytest.fixture(scope="session")
def reference_tokenizer(smollm2_gguf: Path) -> Any:
    """transformers' AutoTokenizer on the default GGUF (~6 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer_folder(reference_tokenizer: Any, tmp_path_factory) -> Path:
    """The GGUF's tokenizer saved by transformers as an HF folder (tokenizer.json, ...)."""
    folder = tmp_path_factory.mktemp("smollm2-hf-tokenizer")
    reference_tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="session")
def sentencepiece_folder(tmp_path_factory) -> Path:
    """A Llama-2-style tokenizer (Metaspace, byte fallback, BOS added by its post-processor)
    trained on a few lines,
    with a named chat template list in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = tmp_path_factory.mktemp("sentencepiece-tokenizer")
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(SENTENCES * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(folder / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}"
        "{% if m.tool_calls is defined %}{{ m.tool_calls | tojson }}{% endif %}{{ eos_token }}"
        "{% endfor %}{% if tools %}TOOLS {{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": [{"name": "default", "template": template}],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
