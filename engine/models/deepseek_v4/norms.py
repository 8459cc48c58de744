"""RMS norms as DeepSeek-V4 computes them (weights kept in fp32, one cast at the end).

Pure functions of their input; never hold state beyond the weight.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight stays fp32 whatever the model dtype (as transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight, scale computed in fp32 and applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
