"""A random-weight Llama checkpoint of a named shape with a tokenizer of the full vocabulary,
written the way a hub checkpoint is (config.json, safetensors shards, tokenizer.json,
tokenizer_config.json), so router, prefill and decode load it like a real model.

The tokenizer is byte-level BPE with no merges: every byte of text is one token, so a prompt of
``n`` characters is ``n`` tokens (plus the chat template's), which lets a benchmark ask for exact
prompt lengths. Ids past the 256 bytes and the specials are filler tokens ``<fN>`` that decode to
their own text: a random model emits ids from the whole vocabulary.

    python -m bench.synthetic_model OUT_DIR --shape llama3-8b [--device cuda]

Weights are made on ``--device`` one tensor at a time (normal, std 0.02; norms 1) and written
in shards of at most ``--shard-gb``; memory stays bounded by one shard.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SPECIALS = ["<|im_start|>", "<|im_end|>", "<bos>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=131072),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, max_position_embeddings=8192),
    # little compute, Llama-3-8B-like KV per layer (8 KV heads of 128): a CPU-sized stand-in
    # where copying KV, not the model, is what a step spends its time on (lab/bench/import_slices.py)
    "kv-heavy": dict(vocab_size=1024, hidden_size=1024, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                     rope_theta=500000.0, max_position_embeddings=131072),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                 max_position_embeddings=8192),
}


def write_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """Byte-level BPE without merges, padded with filler tokens to ``vocab_size``; returns the
    ids of the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} < {len(vocab)} (bytes + specials)")
    for i in range(len(vocab), vocab_size):
        vocab[f"<f{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20,
    }))
    return {t: vocab[t] for t in SPECIALS}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
                                          "model.norm.weight": (h,),
                                          "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    return shapes


def write_llama(folder: Path, shape: str, device: str = "cpu", shard_gb: float = 4.0,
                seed: int = 0) -> Path:
    """Random bf16 Llama of ``shape`` + tokenizer in ``folder``; returns it."""
    from safetensors.torch import save_file

    cfg = dict(SHAPES[shape])
    specials = write_tokenizer(folder, cfg["vocab_size"])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": specials["<bos>"],
              "eos_token_id": specials["<|im_end|>"], **cfg}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator(device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 0
    limit = int(shard_gb * (1 << 30))

    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            index += 1
        shard, shard_bytes = {}, 0

    for name, dims in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = torch.empty(dims, dtype=torch.bfloat16, device=device)
            t.normal_(0.0, 0.02, generator=gen)
            t = t.cpu()
        if shard_bytes + t.numel() * 2 > limit:
            flush()
        shard[name] = t
        shard_bytes += t.numel() * 2
    flush()
    # Several shards need the index the loader (and transformers) read to find each tensor.
    total = sum(2 * _numel(d) for d in tensor_shapes(cfg).values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.synthetic_model")
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default="cpu", help="Where the random values are drawn.")
    p.add_argument("--shard-gb", type=float, default=4.0)
    args = p.parse_args(argv)
    write_llama(args.out, args.shape, args.device, args.shard_gb)
    print(f"wrote {args.shape} to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
