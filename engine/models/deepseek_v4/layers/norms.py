"""RMS norms as DeepSeek-V4 computes them (weights kept in fp32, one cast at the end).

Pure functions of their input; never hold state beyond the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rope_norm import rope_norm


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight stays fp32 whatever the model dtype (as transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 math as transformers (h * rsqrt(mean(h^2) + eps) * weight), in one fused op
        # where the device has one: this norm runs ~6 times a layer, 8 small kernels unfused
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight, scale computed in fp32 and applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm_row(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm of [N, D] rows in place, one launch (``kernels.rope_norm`` with no
    rotated channels): the kernels' form of :class:`RMSNorm`."""
    empty = t.new_empty(t.shape[0], 0)
    return rope_norm(t, empty, empty, t, norm=True, weight=weight, eps=eps)
