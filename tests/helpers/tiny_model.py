"""A tiny random Llama checkpoint with a real byte-level BPE tokenizer and chat template, written
the way a hub checkpoint is (save_pretrained + tokenizer.json + tokenizer_config.json), so every
process of a deployment (router, prefill, decode) can load it from one folder in a second."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The answer is 42. The quick brown fox jumps over the lazy dog, and then some more text.",
    "Hello world! What is the capital of France? Paris is the capital of France.",
    "user assistant system: tell me a story about a cat that sat on a mat in the sun.",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<eos>", "<bos>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def write_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train and save a byte-level BPE; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 2048,
    }))
    return tok.get_vocab_size()


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Random 2-layer Llama (GQA 4:2, head_dim 16) + tokenizer in ``folder``; returns it."""
    import transformers as tf

    vocab = write_tokenizer(folder)
    eos = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=3, eos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms, and logits spread wide enough for stable argmax
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompt: list[int], max_new_tokens: int,
              stop_at_eos: bool = True) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (the reference output)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.config.eos_token_id if stop_at_eos else None
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        # An explicit mask: without it generate() masks every prompt token equal to the pad id.
        input_ids = torch.tensor([prompt])
        ids = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    out = ids[0, len(prompt):].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out
