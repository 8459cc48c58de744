"""The grammar tests' vocabulary: 131 pieces that can spell JSON, which the tiny models' token
ids stand for, an xgrammar compiler over it, and the tiny random engine those tests sample."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.engine.conftest import build_tiny_model
from tests.engine.test_engine_vs_transformers import make_engine

EOS = 2
PIECES = (["<pad>", "<bos>", "<eos>"] + list('{}[]":, ') + list("0123456789")
          + ["true", "false", "null", "-", "."] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
          + ['{"', '":', '",', ' "', "ok", "name", "an"])
VOCAB = PIECES + [f"w{i}" for i in range(131 - len(PIECES))]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50},
                                           "ok": {"type": "boolean"},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["n", "ok", "name"], "additionalProperties": False}


def json_vocab_compiler() -> Any:
    """An xgrammar compiler whose tokens are VOCAB's pieces (EOS stops)."""
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB),
                             stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1)


def compile_schema(compiler: Any, schema: dict) -> Any:
    return compiler.compile_json_schema(json.dumps(schema), strict_mode=True,
                                        any_whitespace=False)


def tiny_qwen2_engine(tmp_path_factory: pytest.TempPathFactory, tag: str) -> Any:
    """A random tiny qwen2 engine (vocabulary of VOCAB's size) in a folder of its own."""
    folder = tmp_path_factory.mktemp(tag)
    build_tiny_model("qwen2").save_pretrained(folder)
    return make_engine(folder, max_context=256, chunk_tokens=32, max_batch=4)
