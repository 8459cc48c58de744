"""PyTorch reference (the specification) of ``kernels.rope_norm``: a DeepSeek-V4 head row's
optional RMSNorm (unweighted, as the queries; or weighted, as the shared KV) followed by the
interleaved partial RoPE of its trailing channels, written to given rows of an output."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_norm_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, norm: bool,
                  weight: torch.Tensor | None = None, eps: float = 1e-6,
                  src_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, H, D] (or [N, D]); cos/sin: [N, R/2] in x's dtype (row i rotates output row i);
    ``src_rows`` [N]: output row i is computed from input row ``src_rows[i]`` (default i).
    ``norm``: RMSNorm over D in fp32 (times ``weight`` [D] fp32 when given), rounded to x's
    dtype, then the last R channels rotate pairwise (x[2p], x[2p+1]) in fp32, rounded again.
    Returns a new tensor shaped as x."""
    if src_rows is not None:
        x = x[src_rows]
    if norm:
        x = F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    half = cos.shape[-1]
    if half == 0:  # a plain RMSNorm
        return x.clone()
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().reshape(shape), sin.float().reshape(shape)
    rope = x[..., -2 * half :]
    x1, x2 = rope[..., 0::2].float(), rope[..., 1::2].float()
    rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : -2 * half], rotated], dim=-1)
