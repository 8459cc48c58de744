"""Which model families exist and which checkpoints belong to each: plain data, no imports.

The one place that names the families. Generic engine code asks
``engine.models.family.family_class`` for a family's implementation (its ``ModelFamily``
subclass) and never tests a family's name.
"""

from __future__ import annotations

# HF ``model_type`` / architecture -> family name.
ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "mistral": "llama",
    "MistralForCausalLM": "llama",
    "qwen2": "qwen2",
    "Qwen2ForCausalLM": "qwen2",
    "qwen3": "qwen3",
    "Qwen3ForCausalLM": "qwen3",
    "deepseek_v4": "deepseek_v4",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}

# family name -> "module:class" of its ModelFamily implementation (imported on first use).
IMPLEMENTATIONS: dict[str, str] = {
    "llama": "engine.models.dense_family:DenseFamily",
    "qwen2": "engine.models.dense_family:DenseFamily",
    "qwen3": "engine.models.dense_family:DenseFamily",
    "deepseek_v4": "engine.models.deepseek_v4.family:DeepseekV4Family",
}

FAMILIES: tuple[str, ...] = tuple(IMPLEMENTATIONS)

# The dense families' facts a config.json leaves out: the default of ``attention_bias`` (bias on
# q/k/v), whether that bias also sits on o_proj, and RMSNorm on q and k per head.
DENSE_TRAITS: dict[str, dict[str, bool]] = {
    "llama": {"attention_bias": False, "o_proj_bias": True, "qk_norm": False},
    "qwen2": {"attention_bias": True, "o_proj_bias": False, "qk_norm": False},
    "qwen3": {"attention_bias": False, "o_proj_bias": True, "qk_norm": True},
}

# GGUF ``general.architecture`` -> the HF architecture it is read as; and the architectures
# whose q/k rows llama.cpp's converter permutes (interleaved rotary halves), undone at load.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
GGUF_PERMUTED_QK: tuple[str, ...] = ("llama",)
