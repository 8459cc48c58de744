"""Split-K slicing and the kernels that finish the MXFP4 MoE (``_mxfp4_moe_triton``, and its
per-pair GEMV form ``_mxfp4_moe_gemv_triton``): the SwiGLU over the gate-up GEMM's split-K
partials, and the combine that sums each token's top-k rows (and the down GEMM's partials).
Both sum in a fixed order: the result does not depend on the split or on scheduling.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._pdl_triton import pdl_wait


@triton.jit
def _k_slice(total, SPLIT_TILES, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """[k_lo, k_hi) of this program's split-K slice (grid axis 2: ``SPLIT_TILES`` K-tiles a
    slice), or the whole ``total`` when not split (static: the plain K loop)."""
    k_lo = 0
    k_hi = total
    if SPLIT:
        k_lo = tl.program_id(2) * SPLIT_TILES * BLOCK_K  # a product with BLOCK_K: aligned
        k_hi = tl.minimum(total, k_lo + SPLIT_TILES * BLOCK_K)
    return k_lo, k_hi



@triton.jit
def _moe_swiglu_split_kernel(p_ptr, h_ptr, INTER, SLICES, stride_ps, stride_pm, stride_hm, limit,
                             BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """h[row, n] = swiglu of the gate and up sums over the split-K slices of the gate-up
    partials p [slices, rows, 2 * INTER] (summed in slice order: deterministic)."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < INTER
    p = p_ptr + r * stride_pm + n
    acc_g = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SLICES):
        acc_g += tl.load(p + s * stride_ps, mask=ok, other=0.0)
        acc_u += tl.load(p + s * stride_ps + INTER, mask=ok, other=0.0)
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    tl.store(h_ptr + r * stride_hm + n, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty),
             mask=ok)



@triton.jit
def _moe_combine_kernel(y_ptr, out_ptr, H, TOP_K, stride_ym, stride_om, SLICES, stride_ys,
                        ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t] (+)= sum_s sum_j y[s, t * TOP_K + j] in fp32, in a fixed order (deterministic);
    ``SLICES`` > 1: the down GEMM's split-K partials."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    o = out_ptr + t.to(tl.int64) * stride_om + cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if ACCUMULATE:
        acc += tl.load(o, mask=ok, other=0.0).to(tl.float32)
    for s in range(0, SLICES):
        for j in range(0, TOP_K):
            acc += tl.load(y_ptr + s * stride_ys + (t.to(tl.int64) * TOP_K + j) * stride_ym
                           + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=ok)


def split_k_slices(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(slices, K-tiles a slice) when ``k`` is cut into at most ``split`` slices of whole
    ``block_k`` tiles, none empty (one slice: the whole K)."""
    tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(tiles, max(split, 1))
    return triton.cdiv(tiles, per), per
