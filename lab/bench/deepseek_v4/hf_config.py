"""A DeepSeek-V4 config as the ``config.json`` dict it was parsed from (the benchmarks build
the engine's ModelConfig from it, as a user's checkpoint folder would)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.deepseek_v4.config import CSA, HCA, DeepseekV4Config, RopeParams


def _rope_dict(p: RopeParams) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(p).items() if v is not None}
    d["rope_theta"] = d.pop("theta")
    return d


def hf_dict(cfg: DeepseekV4Config) -> dict[str, Any]:
    """A config.json dict that parses back to ``cfg`` (what the engine's ModelConfig carries)."""
    d: dict[str, Any] = {
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.rope_head_dim,
        "num_experts_per_tok": cfg.num_experts_per_tok, "n_routed_experts": cfg.n_routed_experts,
        "scoring_func": cfg.scoring_func, "routed_scaling_factor": cfg.routed_scaling_factor,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types), "mlp_layer_types": list(cfg.mlp_layer_types),
        "compress_rates": {CSA: cfg.csa_rate, HCA: cfg.hca_rate},
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "swiglu_limit": cfg.swiglu_limit, "sliding_window": cfg.sliding_window,
        "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {"main": _rope_dict(cfg.main_rope), "compress": _rope_dict(cfg.compress_rope)},
        "eos_token_id": list(cfg.eos_token_ids),
    }
    assert DeepseekV4Config.from_hf_dict(d) == cfg, "hf_dict does not round-trip"
    return d
