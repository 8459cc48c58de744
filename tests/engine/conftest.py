"""Fixtures for engine tests: tiny random HF checkpoints (Llama with llama3 rope scaling, Qwen2,
Qwen3) written with transformers, and the default GGUF model loaded once by transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Awkward on purpose: kv heads < heads, head_dim (Qwen3) != hidden / heads, odd intermediate.
_BASE: dict[str, Any] = {
    "vocab_size": 131,
    "hidden_size": 64,
    "intermediate_size": 88,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def build_tiny_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random transformers CausalLM of ``family`` ('llama' | 'qwen2' | 'qwen3')."""
    import transformers as tf

    kwargs = dict(_BASE)
    if family == "llama":
        config_cls, model_cls = tf.LlamaConfig, tf.LlamaForCausalLM
        kwargs["rope_parameters"] = dict(_LLAMA3_ROPE)
    elif family == "qwen2":
        config_cls, model_cls = tf.Qwen2Config, tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config_cls, model_cls = tf.Qwen3Config, tf.Qwen3ForCausalLM
        kwargs["head_dim"] = 24
    else:
        raise ValueError(family)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # random norms and biases, so a swapped tensor cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def saved_tiny_model(tmp_path_factory: Any, family: str, tag: str, seed: int = 0
                     ) -> tuple[torch.nn.Module, Any]:
    """build_tiny_model saved as an HF folder: (model, folder), for module-scoped fixtures."""
    model = build_tiny_model(family, seed=seed)
    folder = tmp_path_factory.mktemp(tag)
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture
def make_tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``make_tiny_checkpoint("qwen3", sharded=True, tie_word_embeddings=True)`` writes
    a random checkpoint with save_pretrained and returns its folder."""
    counter = iter(range(1_000_000))

    def make(family: str, *, sharded: bool = False, seed: int = 0, **overrides: Any) -> Path:
        model = build_tiny_model(family, seed=seed, **overrides)
        folder = tmp_path / f"{family}-{next(counter)}"
        model.save_pretrained(folder, max_shard_size="40KB" if sharded else "1GB")
        return folder

    return make



@pytest.fixture(scope="session")
def smollm2_transformers_model(smollm2_gguf: Path) -> torch.nn.Module:
    """transformers' own reading of the default GGUF (its config, dequantization and q/k
    un-permutation), ~15 s on 2 cores: built once a session.

    ``from_pretrained(..., gguf_file=...)`` would do the same but insists on ``accelerate``,
    which we do not install; this calls the function it delegates to.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=skeleton)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    result = model.load_state_dict(tensors["tensors"], strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model


@pytest.fixture(scope="session")
def smollm2_transformers_state_dict(
    smollm2_transformers_model: torch.nn.Module,
) -> dict[str, torch.Tensor]:
    return dict(smollm2_transformers_model.state_dict())
