"""Model families. ``build_model`` picks the implementation for a ModelConfig."""

from __future__ import annotations

import torch

from engine.attention import AttentionShape
from engine.errors import CheckpointError
from engine.model_config import ModelConfig
from engine.rope import RotaryTable


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor], rope: RotaryTable,
                attn_shape: AttentionShape):
    if cfg.family in ("llama", "qwen2", "qwen3"):
        from engine.models.dense import DenseDecoder
        return DenseDecoder(cfg, weights, rope, attn_shape)
    raise CheckpointError(f"model family {cfg.family!r} is not served by the dense engine yet")
