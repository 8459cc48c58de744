"""Specification of the block-scaled FP8 linear: dequantize the weight, then one matmul.

DeepSeek's layout: ``weight`` e4m3 ``[N, K]``, ``scale`` fp32 ``[ceil(N / bn), ceil(K / bk)]``
(128 x 128 blocks in the shipped checkpoints; the last block row/column may be partial). The
scale multiplies the stored value (it is the dequantization factor, not its inverse, whatever the
tensor is called). Slow and allocating by design: it is what the Triton kernel is checked against.
"""

from __future__ import annotations

import torch


def fp8_block_scale_fp32(scale: torch.Tensor) -> torch.Tensor:
    """A block-scale grid as fp32: fp32/bf16 as is, e8m0 (``float8_e8m0fnu`` or its uint8
    exponent bytes) as ``2 ** (byte - 127)``."""
    if scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return (scale.view(torch.uint8).to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """weight e4m3 (or its uint8 bits) [N, K], scale [ceil(N/bn), ceil(K/bk)] -> fp32 [N, K]."""
    w = weight.view(torch.float8_e4m3fn).to(torch.float32)
    s = fp8_block_scale_fp32(scale)
    n, k = w.shape
    s = s.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return w * s


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] -> x @ dequant(weight)^T [M, N] in x's dtype (fp32 accumulation)."""
    return (x.to(torch.float32) @ dequantize_fp8_block(weight, scale, block).t()).to(x.dtype)


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, G, K], weight [G * N, K] block-diagonal -> [M, G * N] in x's dtype."""
    m, groups, k = x.shape
    w = dequantize_fp8_block(weight, scale, block).view(groups, -1, k)
    return torch.einsum("mgk,gnk->mgn", x.to(torch.float32), w).reshape(m, -1).to(x.dtype)
