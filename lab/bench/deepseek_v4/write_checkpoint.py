"""Writes a synthetic DeepSeek-V4-Flash-shaped checkpoint in the on-disk layout of the HF
V4-Flash files: size-bounded ``model-0000K-of-0000N.safetensors`` shards in DeepSeek's own tensor
names with ``model.safetensors.index.json``, a ``config.json`` in V4-Flash's own keys, tokenizer
files; random weights with FP8 e4m3 + 128 x 128 block scales for the dense projections and MXFP4
(packed e2m1 + e8m0 per 32) for the routed experts (see :mod:`engine.models.deepseek_v4.weights.checkpoint_specs`).

    python -m lab.bench.deepseek_v4.write_checkpoint OUT_DIR --layers 43 --experts 128 --dry-run
    python -m lab.bench.deepseek_v4.write_checkpoint OUT_DIR --layers 4 --experts 8 --hidden 256
    python -m lab.bench.deepseek_v4.write_checkpoint OUT_DIR --layers 43 --experts 128 --config-only

Memory stays bounded by one shard: tensors are made one by one, a shard is written and dropped
before the next is filled (the full 43 x 128 model is ~77 GiB on disk). ``--hidden`` below
4096 scales the other widths with it (a small model for tests). No MTP layer is written, so
``num_nextn_predict_layers`` is 0. Never imported by the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.weights.checkpoint_specs import (
    TensorSpec,
    checkpoint_specs,
    make_tensor,
)
from lab.bench.deepseek_v4.quantized_weights import QUANTIZATION_CONFIG

FLASH_HIDDEN = 4096
FLASH_VOCAB = 129280
INDEX_FILE = "model.safetensors.index.json"


def flash_compress_ratios(num_layers: int) -> list[int]:
    """V4-Flash's attention schedule cut to ``num_layers``: its config.json's ``compress_ratios``
    are 0, 0 (sliding-window layers), then 4 (CSA) and 128 (HCA) alternating up to layer 42 (a
    CSA layer); the file's 44th entry (0) is the MTP block's, not written here."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(num_layers)]


def flash_hf_config(layers: int, experts: int, hidden: int = FLASH_HIDDEN, vocab: int = FLASH_VOCAB,
                    bos: int = 0, eos: int = 1) -> dict[str, Any]:
    """config.json in V4-Flash's own keys (``compress_ratios``, ``num_hash_layers``,
    ``qk_rope_head_dim``, ``rope_scaling``, ``expert_dtype``, ``quantization_config``) with its
    values at ``hidden`` 4096; a smaller ``hidden`` (a multiple of 256) scales every width."""
    if layers < 1 or experts < 1:
        raise ValueError(f"--layers ({layers}) and --experts ({experts}) must be at least 1")
    if hidden % 256 or not 256 <= hidden <= FLASH_HIDDEN:
        raise ValueError(f"--hidden must be a multiple of 256 in [256, {FLASH_HIDDEN}], got {hidden}")
    f = hidden / FLASH_HIDDEN
    heads = int(64 * f)
    head_dim = max(32, int(512 * f))
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab, "hidden_size": hidden, "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1,
        "head_dim": head_dim, "qk_rope_head_dim": head_dim // 8, "q_lora_rank": int(1024 * f),
        "o_lora_rank": int(1024 * f), "o_groups": math.gcd(8, heads),
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": min(6, experts),
        "num_hash_layers": min(3, layers), "compress_ratios": flash_compress_ratios(layers),
        "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                         "original_max_position_embeddings": 65536, "type": "yarn"},
        "index_n_heads": heads, "index_head_dim": max(16, int(128 * f)),
        "index_topk": max(8, int(512 * f)), "sliding_window": 128,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": bos, "eos_token_id": eos, "expert_dtype": "fp4",
        "quantization_config": {k: v for k, v in QUANTIZATION_CONFIG.items() if k != "expert_dtype"},
    }


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors packed into shards of at most ``max_shard_bytes`` data bytes each."""
    biggest = max(specs, key=lambda s: s.nbytes)
    if biggest.nbytes > max_shard_bytes:
        raise ValueError(f"--max-shard-mb: {biggest.name} alone is {biggest.nbytes} bytes, over the "
                         f"shard bound of {max_shard_bytes} bytes")
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for s in specs:
        if used + s.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(s)
        used += s.nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def write_tokenizer(out: Path) -> tuple[int, int, int]:
    """SmolLM2's byte-level BPE (the default model's GGUF, exported to tokenizer.json with its
    ChatML template); returns (vocab size, bos id, eos id)."""
    from common.default_model import default_model_path
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    tok.backend.save(str(out / "tokenizer.json"))
    specials = {k: v for k, v in tok.special_tokens.items() if v}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {**specials, "chat_template": tok.chat_template_source, "model_max_length": 1048576}, indent=1))
    return tok.vocab_size, tok.bos_token_id or 0, tok.eos_token_ids[0]


def write_shards(out: Path, cfg: DeepseekV4Config, shards: list[list[TensorSpec]], seed: int,
                 log: Any = None) -> dict[str, Any]:
    """Each shard made, written and dropped in turn; returns the index dict (also written)."""
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards):
        name = shard_name(k, len(shards))
        tensors = {s.name: make_tensor(s, cfg, gen) for s in shard}
        save_file(tensors, out / name, metadata={"format": "pt"})
        del tensors
        weight_map.update({s.name: name for s in shard})
        total += sum(s.nbytes for s in shard)
        if log is not None:
            print(f"{name}: {len(shard)} tensors, {sum(s.nbytes for s in shard) / 2**30:.2f} GiB", file=log)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return index


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.write_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, required=True, help="decoder layers (V4-Flash: 43)")
    p.add_argument("--experts", type=int, required=True, help="routed experts a layer (V4-Flash: 256)")
    p.add_argument("--hidden", type=int, default=FLASH_HIDDEN, help="hidden size; below 4096 every width scales")
    p.add_argument("--vocab", type=int, default=None,
                   help=f"embedding rows (default {FLASH_VOCAB}; at least the tokenizer's 49152)")
    p.add_argument("--max-shard-mb", type=int, default=3500, help="data bytes a shard holds at most, MiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print total bytes and shard count, write nothing")
    p.add_argument("--config-only", action="store_true",
                   help="config.json, generation_config.json and the tokenizer, no weights: a "
                   "folder served with --load-format dummy")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    vocab = args.vocab or FLASH_VOCAB
    try:
        hf = flash_hf_config(args.layers, args.experts, args.hidden, vocab)
        cfg = DeepseekV4Config.from_hf_dict(hf)
        specs = list(checkpoint_specs(cfg))
        shards = plan_shards(specs, args.max_shard_mb << 20)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = sum(s.nbytes for s in specs)
    print(f"{len(specs)} tensors, {total} bytes ({total / 2**30:.2f} GiB), {len(shards)} shards "
          f"of at most {args.max_shard_mb} MiB")
    if args.dry_run:
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if any(args.out_dir.glob("*.safetensors")):
        print(f"error: {args.out_dir} already holds safetensors files", file=sys.stderr)
        return 2
    tok_vocab, bos, eos = write_tokenizer(args.out_dir)
    if tok_vocab > vocab:
        print(f"error: --vocab {vocab} is below the tokenizer's {tok_vocab} tokens", file=sys.stderr)
        return 2
    hf.update(bos_token_id=bos, eos_token_id=eos)
    (args.out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    (args.out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    if args.config_only:
        print(f"wrote {args.out_dir}/config.json and the tokenizer (no weights: serve it with "
              "--load-format dummy)")
        return 0
    write_shards(args.out_dir, cfg, shards, args.seed, log=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
