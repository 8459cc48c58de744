"""Specification of the prefill form of the block-scaled FP8 linear: activations quantized to
e4m3 per 1 x 128 group, then an FP8 x FP8 product with fp32 accumulation.

This is what DeepSeek's own inference code does for its FP8 projections (``act_quant`` then a
w8a8 block-scaled GEMM) and what transformers' fine-grained FP8 path does: each row of the
activations is cut into groups of ``group`` values along K (the weight's K block, 128 in every
shipped checkpoint; the last group may be partial), each group gets one fp32 scale
``amax / 448`` and its values are rounded to the nearest e4m3 (ties to even). The product of a
K-group is exact in fp32, so the only change against ``kernels.fp8_linear_ref`` is that
rounding of the activations (relative error <= 2**-4 a value, ~1e-2 on a random row).
Slow and allocating by design: what the Triton kernels are checked against.
"""

from __future__ import annotations

import torch

from kernels.fp8_linear_ref import dequantize_fp8_block

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10  # an all-zero group gets this amax: its scale stays finite, its codes zero


def fp8_act_quant_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes e4m3 [..., K], scale fp32 [..., ceil(K / group)]) with
    ``x ~= codes * scale`` group by group."""
    *lead, k = x.shape
    groups = -(-k // group)
    pad = torch.zeros(*lead, groups * group, dtype=torch.float32, device=x.device)
    pad[..., :k] = x.float()
    g = pad.view(*lead, groups, group)
    scale = g.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) / E4M3_MAX
    q = (g / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, groups * group)[..., :k].contiguous(), scale


def fp8_act_dequant_ref(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """The inverse view: codes [..., K] and scales [..., ceil(K / group)] -> fp32 [..., K]."""
    k = q.shape[-1]
    return q.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(group, dim=-1)[..., :k]


def fp8_linear_w8a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] -> quant(x) @ dequant(weight)^T [M, N] in x's dtype (fp32 accumulation)."""
    q, s = fp8_act_quant_ref(x, block[1])
    xd = fp8_act_dequant_ref(q, s, block[1])
    return (xd @ dequantize_fp8_block(weight, scale, block).t()).to(x.dtype)


def fp8_grouped_linear_w8a8_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, G, K], weight [G * N, K] block-diagonal -> [M, G * N] in x's dtype."""
    m, groups, k = x.shape
    q, s = fp8_act_quant_ref(x, block[1])
    xd = fp8_act_dequant_ref(q, s, block[1])
    w = dequantize_fp8_block(weight, scale, block).view(groups, -1, k)
    return torch.einsum("mgk,gnk->mgn", xd, w).reshape(m, -1).to(x.dtype)
