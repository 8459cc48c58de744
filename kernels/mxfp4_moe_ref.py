"""Specification of the MXFP4 routed experts: dequantize, then per-expert matmuls.

Layout (DeepSeek-V4's experts as shipped): e2m1 values packed two per byte, the lower nibble the
even column; one e8m0 scale (a byte ``b`` meaning ``2 ** (b - 127)``) per 32 values along K.
``gate_up [E, 2I, H/2]`` (gate rows then up rows), ``down [E, H, I/2]``, scales ``[E, 2I, H/32]``
and ``[E, H, I/32]``. ``quantize_mxfp4`` is the inverse the tests and the synthetic-checkpoint
writer use. Slow and allocating by design, with a Python loop over experts: the specification
the fused kernels are checked against, never a serving path on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """int8 / float4_e2m1fn_x2 / float8_e8m0fnu payloads as their uint8 bytes (no copy)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [..., N, K/2] bytes, scale [..., N, K/32] e8m0 bytes -> fp32 [..., N, K]."""
    u8, s8 = as_bytes(packed), as_bytes(scale)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=u8.device)
    w = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)
    s = (s8.to(torch.float32) - 127.0).exp2().repeat_interleave(MXFP4_GROUP, dim=-1)
    return w * s


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., N, K] (K a multiple of 32) -> (packed uint8 [..., N, K/2], e8m0 uint8 scale
    [..., N, K/32]): a power-of-two scale per 32 values so the largest lands within +-6, then
    round to the nearest e2m1 value."""
    *lead, n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4: K={k} must be a multiple of {MXFP4_GROUP}")
    g = w.float().reshape(*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(dim=-1).clamp(min=2.0**-100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = g / exp.exp2()[..., None]
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    code = (q.abs()[..., None] - mags).abs().argmin(dim=-1)  # nearest magnitude, 0..7
    code = (code + 8 * (q < 0)).to(torch.uint8).reshape(*lead, n, k)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's activation: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_experts_ref(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
    down_scale: torch.Tensor, swiglu_limit: float,
) -> torch.Tensor:
    """x [T, H], topk_weights [T, k], topk_ids [T, k] -> sum_j w[t, j] * expert_{id[t, j]}(x[t])
    [T, H] in x's dtype, computed in fp32. An id may repeat within a row (hash routing)."""
    return _experts(x, topk_weights, topk_ids, gate_up, gate_up_scale, down, down_scale,
                    swiglu_limit, lambda a: a.float())


def moe_experts_fp8_ref(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
    down_scale: torch.Tensor, swiglu_limit: float,
) -> torch.Tensor:
    """The prefill (FP8) form of :func:`moe_experts_ref`: each token quantized to e4m3 per
    1 x 128 group (``kernels.fp8_w8a8_ref``), each expert's SwiGLU output likewise, before
    the exact MXFP4 weights multiply them in fp32."""
    from kernels.fp8_w8a8_ref import fp8_act_dequant_ref, fp8_act_quant_ref

    return _experts(x, topk_weights, topk_ids, gate_up, gate_up_scale, down, down_scale,
                    swiglu_limit, lambda a: fp8_act_dequant_ref(*fp8_act_quant_ref(a)))


def _experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
             down_scale: torch.Tensor, swiglu_limit: float,
             act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Both forms: ``act`` gives what each GEMM's activations are (fp32, or FP8-rounded)."""
    t, k = topk_ids.shape
    xa = act(x)
    inter = down.shape[-1] * 2
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tok = pairs // k
        gu = xa[tok] @ dequantize_mxfp4(gate_up[e], gate_up_scale[e]).t()
        h = act(clamped_swiglu_ref(gu[:, :inter], gu[:, inter:], swiglu_limit))
        y = h @ dequantize_mxfp4(down[e], down_scale[e]).t()
        out.index_add_(0, tok, y * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(x.dtype)
