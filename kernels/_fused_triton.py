"""Triton kernels of ``kernels.fused``: one program per row (norm), per (token, head) (rotary +
KV write) or per (row, column tile) (SiLU-and-multiply). They exist to cut a decode step's
kernel count: each replaces 3-14 small PyTorch kernels whose launch cost dominates at batch 1.

Intermediate results are rounded to the storage dtype exactly where the unfused PyTorch code
rounds, so a fused step computes the same numbers as the reference. Nothing allocates here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_support import next_pow2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        s = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_res + cols, s, mask=mask)
    else:
        s = x
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / n_cols
    normed = (sf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                        eps: float, out: torch.Tensor) -> None:
    n, c = x.shape
    block = next_pow2(c)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(n,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), c, eps,
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )


@triton.jit
def _rotate_half(x_ptr, c_ptr, s_ptr, offs, mask, HALF: tl.constexpr):
    """Rotary of one head vector (HF rotate_half), rounding as the unfused code does:
    x * cos and rotate_half(x) * sin are each rounded, then their sum."""
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + HALF + offs, mask=mask, other=0.0)
    dt = x1.dtype
    c1 = tl.load(c_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * c1).to(dt).to(tl.float32) + (-x2f * s1).to(dt).to(tl.float32)
    o2 = (x2f * c2).to(dt).to(tl.float32) + (x1f * s2).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _e4m3_bits(x):
    """FP8 e4m3fn bits (uint8) of fp32 ``x``: clamped to +-448, rounded to nearest even, as
    ``kernels.kv_quant.quantize_kv``. Integer arithmetic rather than ``x.to(tl.float8e4nv)``:
    the Triton interpreter's fp8 downcast drops the carry when rounding reaches the next
    exponent (0.0309 -> 0.0156) and flushes subnormals, so a CPU test of the cast would prove
    nothing; this is exact on every backend and costs a few integer ops per element."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: drop 20 of fp32's 23 mantissa bits with round-half-even (a carry moves
    # into the exponent by itself), then rebias the exponent from 127 to 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6 e4m3fn is subnormal, multiples of 2^-9: round |x| * 512 to an integer (the
    # 2^23 addition rounds half-even), which is also the encoding (8 = the smallest normal).
    absx = mag.to(tl.float32, bitcast=True)
    sub = ((absx * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return (tl.where(absx < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _store_kv(ptr, x, mask, KV_FP8: tl.constexpr):
    """Store K or V values ``x`` into the cache as the cache stores them."""
    if KV_FP8:
        tl.store(ptr, _e4m3_bits(x.to(tl.float32)).to(tl.float8e4nv, bitcast=True), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qo_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cos,
    stride_cache_slot, stride_cache_h, stride_qon, stride_qoh,
    NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    pos = tl.load(pos_ptr + tok)
    c_ptr = cos_ptr + pos * stride_cos
    s_ptr = sin_ptr + pos * stride_cos
    if head < NUM_Q_HEADS:
        o1, o2 = _rotate_half(q_ptr + tok * stride_qn + head * stride_qh, c_ptr, s_ptr, offs,
                              mask, HALF)
        dst = qo_ptr + tok * stride_qon + head * stride_qoh
        tl.store(dst + offs, o1, mask=mask)
        tl.store(dst + HALF + offs, o2, mask=mask)
    else:
        kh = head - NUM_Q_HEADS
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        o1, o2 = _rotate_half(k_ptr + tok * stride_kn + kh * stride_kh, c_ptr, s_ptr, offs,
                              mask, HALF)
        # not ``dst``: a name must keep one type across the if/else (q_out's and the cache's
        # pointer types differ when the cache is FP8)
        kdst = kc_ptr + slot * stride_cache_slot + kh * stride_cache_h
        _store_kv(kdst + offs, o1, mask, KV_FP8)
        _store_kv(kdst + HALF + offs, o2, mask, KV_FP8)
        src = v_ptr + tok * stride_vn + kh * stride_vh
        vdst = vc_ptr + slot * stride_cache_slot + kh * stride_cache_h
        _store_kv(vdst + offs, tl.load(src + offs, mask=mask), mask, KV_FP8)
        _store_kv(vdst + HALF + offs, tl.load(src + HALF + offs, mask=mask), mask, KV_FP8)


def launch_rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, q_out: torch.Tensor) -> None:
    n, hq, d = q.shape
    hkv = k.shape[1]
    kc = k_cache.view(-1, hkv, d)
    vc = v_cache.view(-1, hkv, d)
    half = d // 2
    _rope_and_cache_kernel[(n, hq + hkv)](
        q, k, v, positions, cos, sin, slot_mapping, kc, vc, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), kc.stride(0), kc.stride(1), q_out.stride(0), q_out.stride(1),
        NUM_Q_HEADS=hq, HALF=half, BLOCK_HALF=next_pow2(half),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=1,
    )


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, out_ptr, stride_g, stride_u, stride_out, n_cols,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    n, i = gate.shape
    block = min(1024, next_pow2(i))
    _silu_and_mul_kernel[(n, triton.cdiv(i, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), i, BLOCK=block,
        num_warps=4,
    )
