"""PyTorch reference (the specification) of ``kernels.moe_decode``: DeepSeek-V4's MoE routing
(scores, top-k, normalised and scaled weights) and the shared expert's clamped SwiGLU, in the
model's dtype with its rounding (transformers' formulation, as engine/models/deepseek_v4/layers/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORINGS = ("sqrtsoftplus", "sigmoid", "softmax")


def moe_route_ref(logits: torch.Tensor, top_k: int, scoring: str, scaling: float,
                  bias: torch.Tensor | None = None, hash_table: torch.Tensor | None = None,
                  token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] (the router's output, model dtype) -> (weights [N, k] fp32, experts [N, k]
    int64). Score-routed: top-k of ``scores + bias`` (bias fp32 [E]); hash-routed:
    ``hash_table[token_ids]`` ([vocab, k]). Weights: the picked scores over their sum, times
    ``scaling``."""
    if scoring == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    if hash_table is not None:
        assert token_ids is not None
        experts = hash_table[token_ids].long()
    else:
        assert bias is not None
        experts = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, experts)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return (w * scaling).float(), experts


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in the inputs' dtype."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
