"""lab.bench.grammar without any model file: the synthetic Llama it writes loads in the engine, its
tokenizer (trained offline on the repo's text) is a real multi-character BPE that xgrammar takes,
and the benchmark runs end to end on it (a CPU smoke run of a small shape; the H200 figures use
the default SmolLM2-135M shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.tokenizer import Tokenizer
from engine.checkpoint import load_checkpoint
from lab.bench import grammar
from lab.bench.repo_bpe import write_bpe_llama

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bpe_llama(tmp_path_factory.mktemp("synthetic") / "m", "tiny")


def test_the_synthetic_checkpoint_loads_with_a_real_bpe(folder: Path) -> None:
    ckpt = load_checkpoint(folder, dtype=torch.float32, progress=False)
    assert ckpt.config.num_layers == 2 and ckpt.config.vocab_size == 1024
    tok = Tokenizer.from_path(folder)
    text = '{"items": [12, 345, 6789], "name": "json_schema"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # even with 1024 entries the merges make multi-character tokens (a byte tokenizer: 49)
    assert len(ids) < 0.75 * len(text)
    assert max(len(tok.decode([i])) for i in ids) >= 4
    assert tok.eos_token_ids


def test_the_benchmark_runs_on_it(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    rc = grammar.main(["--model", str(folder), "--device", "cpu", "--batches", "1,2",
                       "--steps", "3", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["free_tok_s"] > 0 and r["json_schema_tok_s"] > 0 for r in rows)


def test_without_a_model_it_falls_back_to_synthetic(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(grammar, "write_bpe_llama",
                        lambda path, device: write_bpe_llama(path, "tiny", device))
    monkeypatch.setattr(grammar.importlib.util, "find_spec", lambda name: None)
    path, label = grammar.resolve_model("", tmp_path)
    assert label.startswith("synthetic") and (Path(path) / "config.json").is_file()
    assert (Path(path) / "model.safetensors.index.json").is_file()
