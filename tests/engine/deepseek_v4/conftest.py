"""Tiny random DeepSeek-V4 models built with transformers, in several mixes of layer types,
compress rates, hc_mult, window sizes and rope kinds, with every tensor perturbed (sinks,
position biases, routing biases, hash table) so a swapped or ignored tensor cannot hide."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.step_batch import StepBatch

_BASE: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 32,
    "moe_intermediate_size": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "q_lora_rank": 24,
    "partial_rotary_factor": 0.5,
    "num_experts_per_tok": 2,
    "n_routed_experts": 5,
    "hc_sinkhorn_iters": 5,
    "o_lora_rank": 8,
    "index_head_dim": 12,
    "index_n_heads": 8,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# name -> overrides. Prompts in the tests are ~40 tokens, so csa_rate 4 closes ~10 windows,
# index_topk 3 < visible entries (the indexer's choice matters), HCA rate 8/16 closes a few.
CONFIGS: dict[str, dict[str, Any]] = {
    "s-csa-hca_yarn_hc2": {
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "hc_mult": 2,
        "sliding_window": 6,
        "o_groups": 2,
        "index_topk": 3,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    },
    "csa-hca-csa-s_hc3_topk_all": {
        "num_hidden_layers": 4,
        "layer_types": [
            "compressed_sparse_attention", "heavily_compressed_attention",
            "compressed_sparse_attention", "sliding_attention",
        ],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "hc_mult": 3,
        "sliding_window": 5,
        "o_groups": 4,
        "index_topk": 64,
    },
    "legacy_fields_hc1_csa8": {
        # legacy DeepSeek names, folded by both transformers and our parser
        "num_hidden_layers": 3,
        "compress_ratios": [4, 128, 0],
        "compress_rate_csa": 8,
        "compress_rate_hca": 12,
        "num_hash_layers": 1,
        "qk_rope_head_dim": 4,
        "partial_rotary_factor": None,
        "hc_mult": 1,
        "sliding_window": 9,
        "o_groups": 1,
        "index_topk": 2,
        "scoring_func": "sigmoid",
    },
}
# V4-Flash's real rates and window at toy widths (the first config's layer kinds in another
# order); prompts of ~380 tokens close two (then three) HCA windows and ~95 CSA windows, with
# index_topk 8 of them chosen per query
CONFIGS["flash_rates_window128"] = {
    **CONFIGS["s-csa-hca_yarn_hc2"],
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "sliding_window": 128,
    "index_topk": 8,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32},
}
# The per-config test matrix runs over these; the real-rates config has its own longer test.
SHORT_CONFIGS = ("s-csa-hca_yarn_hc2", "csa-hca-csa-s_hc3_topk_all", "legacy_fields_hc1_csa8")


def build_hf_v4(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(transformers DeepseekV4ForCausalLM in eval mode, the raw config dict it was built from)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = {**_BASE, **CONFIGS[name]}
    raw = {k: v for k, v in raw.items() if v is not None}
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**raw)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    cfg = model.config
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "sinks" in pname or "bias" in pname else 0.05))
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                        for _ in range(cfg.vocab_size)]
                b.copy_(torch.stack(rows))
            elif bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model, raw


@pytest.fixture(scope="module", params=SHORT_CONFIGS)
def hf_v4(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, dict[str, Any]]:
    model, raw = build_hf_v4(request.param)
    return request.param, model, raw


@pytest.fixture(scope="session")
def v4_builder() -> Callable[..., tuple[torch.nn.Module, dict[str, Any]]]:
    """``v4_builder(name, seed=0)`` -> (transformers model, raw config dict)."""
    return build_hf_v4


def step_batch(seqs: list[tuple[list[int], int, int]],
               tables: dict[int, list[int]]) -> StepBatch:
    """A runner StepBatch from host lists: seqs are (this step's token ids, start position,
    slot); ``tables[slot]``: that slot's blocks."""
    ids, pos, qsl, ctx, slots = [], [], [0], [], []
    for toks, start, slot in seqs:
        ids += toks
        pos += list(range(start, start + len(toks)))
        qsl.append(qsl[-1] + len(toks))
        ctx.append(start + len(toks))
        slots.append(slot)
    return StepBatch(torch.tensor(ids), torch.tensor(pos), torch.zeros(len(ids), dtype=torch.long),
                     qsl, ctx, [tables[s] for s in slots], slots,
                     torch.tensor([q - 1 for q in qsl[1:]]))
