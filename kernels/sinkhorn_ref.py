"""PyTorch reference (the specification) of ``kernels.sinkhorn``: DeepSeek-V4's mHC stream-mixing
matrix, a softmax over each row projected towards doubly-stochastic by Sinkhorn iterations."""

from __future__ import annotations

import torch


def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits: [N, m, m] fp32 -> [N, m, m] fp32: softmax over the last dim plus ``eps``, divided
    by its column sums, then ``iters - 1`` rounds of row then column normalisation (each sum
    plus ``eps``), as transformers' DeepSeek-V4 hyper-connection computes it."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb
