"""``bulkhead export-tokenizer DIR``: write a model's tokenizer (HF folder or GGUF) as a Hugging
Face tokenizer folder, so clients that load a tokenizer by path (aiperf, guidellm, lm-eval) can
be pointed at a GGUF-served model offline.

Writes tokenizer.json, tokenizer_config.json (special tokens, chat template, the backend class
transformers should use) and special_tokens_map.json. Torch-free; refuses to overwrite files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from common.tokenizer import Tokenizer, TokenizerError

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_tokenizer(model: str, out_dir: Path, force: bool = False) -> list[Path]:
    """Write the files of ``FILES`` into ``out_dir``; returns their paths."""
    tok = Tokenizer.from_path(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in FILES]
    existing = [p.name for p in paths if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{out_dir} already has {', '.join(existing)} (use --force)")
    specials = {k: v for k, v in tok.special_tokens.items() if v}
    eos = [tok.backend.id_to_token(i) for i in tok.eos_token_ids]
    if eos and "eos_token" not in specials:
        specials["eos_token"] = eos[0]
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                 "clean_up_tokenization_spaces": False,
                                 "add_bos_token": False, **specials}
    if tok.chat_template_source:
        config["chat_template"] = tok.chat_template_source
    tok.backend.save(str(paths[0]))
    paths[1].write_text(json.dumps(config, indent=2, ensure_ascii=False))
    paths[2].write_text(json.dumps(specials, indent=2, ensure_ascii=False))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bulkhead export-tokenizer", description=__doc__)
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--model", default="", help="HF folder or .gguf (default: the default "
                        "model, SmolLM2-135M-Instruct's GGUF)")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    args = parser.parse_args(argv)
    model = args.model
    if not model:
        from common.default_model import default_model_path

        model = str(default_model_path())
    try:
        paths = export_tokenizer(model, args.out_dir, args.force)
    except (TokenizerError, OSError) as exc:
        print(f"bulkhead export-tokenizer: {exc}", file=sys.stderr)
        return 1
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
