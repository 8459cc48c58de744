"""Model families. ``build_model`` picks the implementation for a ModelConfig.

Every family offers ``forward(batch: StepBatch, kv: KVCache, ws: Workspace) -> hidden [N, h]``
and ``compute_logits(hidden [n, h], out [n, vocab]) -> out``. Families whose attention state is
not the paged KV (DeepSeek-V4: per-sequence compressor state) own it, allocated once here.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionShape
from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.rope import RotaryTable

DENSE_FAMILIES = ("llama", "qwen2", "qwen3")


def uses_paged_kv(cfg: ModelConfig) -> bool:
    """Whether the family keeps its attention state in the engine's paged KV cache (and so can
    share prefixes by block hash and be handed off block by block)."""
    return cfg.family in DENSE_FAMILIES


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], ec: EngineConfig):
    device, dtype = ec.torch_device, ec.torch_dtype
    if cfg.family in DENSE_FAMILIES:
        from engine.models.dense import DenseDecoder

        rope = RotaryTable(cfg.rope, cfg.head_dim, ec.max_context, cfg.max_position_embeddings,
                           dtype, device)
        shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ec.block_size,
                               ec.attn_tile_tokens)
        return DenseDecoder(cfg, weights, rope, shape, fused=ec.use_triton_attention)
    if cfg.family == "deepseek_v4":
        from engine.models.deepseek_v4.runner import DeepseekV4Runner

        return DeepseekV4Runner(cfg.hf_config, weights, max_batch=ec.max_batch,
                                max_context=ec.max_context, dtype=dtype, device=device,
                                weight_format=ec.weight_format)
    raise CheckpointError(f"model family {cfg.family!r} is not served yet")


def prepare_warmup_slot(model, slot: int, num_tokens: int) -> None:
    """Make a family's per-slot state claim ``num_tokens`` tokens so the warm-up can run the
    worst-case step (its contents are garbage; the slot is reset before serving)."""
    cache = getattr(model, "cache", None)
    if cache is not None and hasattr(cache, "num_tokens"):
        cache.num_tokens[slot] = num_tokens


def reset_slots(model) -> None:
    cache = getattr(model, "cache", None)
    if cache is not None and hasattr(cache, "reset_slot"):
        for slot in range(cache.max_batch):
            cache.reset_slot(slot)
