"""A Llama-family KV layout of any geometry, from a config.json alone (no weights): what a
store test needs to put and fetch blocks of a given size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def llama_kv_layout(folder: Path, **dims: Any) -> Any:
    """Write ``folder/config.json`` for a Llama with ``dims`` (layers, heads, head_dim, ...) over
    a small default, and return the engine's KV layout for it on the CPU in bf16."""
    from engine.checkpoint import load_model_config
    from engine.config import EngineConfig
    from engine.models.family import family_class

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
              **dims}
    (folder / "config.json").write_text(json.dumps(config))
    cfg = load_model_config(str(folder))
    return family_class(cfg).kv_layout(cfg, EngineConfig(model=str(folder), device="cpu",
                                                         dtype="bfloat16"))
