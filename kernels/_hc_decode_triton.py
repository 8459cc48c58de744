"""Triton kernels of ``kernels.hc_decode``: three launches between two blocks of a decode step.

1. ``_hc_mix_kernel``, one program per (token, slice of the hidden dim): merges the previous
   block into the slice of the streams (optional), then its partial dot products with every
   row of ``fn`` and its partial sum of squares -> ``partial[token, slice, :]``. Split over the
   hidden dim because ``fn`` (24 x 16384 fp32 at V4-Flash) is the bytes to stream, and one
   program per token would leave all but B SMs idle at batch 1.
2. ``_hc_finish_kernel``, one program per (token, slice): sums the partials into the gates
   (sigmoid) and Sinkhorn on the m x m matrix in registers (every slice redoes this tiny work
   rather than waiting for one program; slice 0 stores post and comb), then its slice of the
   collapse and the slice's sum of squares.
3. ``_hc_norm_kernel``, per (token, slice): the weighted RMSNorm of the collapse in place.
   One program per token for 2 and 3 took ~20 us at batch 1 (a 4 x 4096 row walked by one SM).
Nothing allocates here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._pdl_triton import pdl_wait
from kernels._triton_support import cdiv, next_pow2, pdl_kwargs

HC_MIX_BLOCK_D = 64  # hidden channels per mix program: fn tile rows x m x 64 fp32 in registers


@triton.jit
def _hc_mix_kernel(s_ptr, fn_ptr, part_ptr, post_ptr, comb_ptr, bo_ptr, out_ptr,
                   m, d, rows, num_slices,
                   stride_sn, stride_sr, stride_fr, stride_bn, stride_on, stride_or,
                   MERGE: tl.constexpr, F32: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    tok = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    cols = sl * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    ok_m = j < m
    ok_d = cols < d
    ok = ok_m[:, None] & ok_d[None, :]
    s = tl.load(s_ptr + tok * stride_sn + j[:, None] * stride_sr + cols[None, :], mask=ok,
                other=0.0).to(tl.float32)  # [M, D]
    if MERGE:
        # new[i] = post[i] * out + sum_j comb[j, i] * s[j], as kernels.hc_streams.hc_merge
        bo = tl.load(bo_ptr + tok * stride_bn + cols, mask=ok_d, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + tok * m + j, mask=ok_m, other=0.0)
        comb = tl.load(comb_ptr + tok * m * m + j[:, None] * m + j[None, :],
                       mask=ok_m[:, None] & ok_m[None, :], other=0.0)
        if not F32:
            post = post.to(out_ptr.dtype.element_ty).to(tl.float32)
            comb = comb.to(out_ptr.dtype.element_ty).to(tl.float32)
        new = post[:, None] * bo[None, :] + tl.sum(comb[:, :, None] * s[:, None, :], axis=0)
        new = new.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tok * stride_on + j[:, None] * stride_or + cols[None, :], new, mask=ok)
        s = tl.where(ok, new.to(tl.float32), 0.0)  # the rounded streams, as the next pass reads
    r = tl.arange(0, BLOCK_R)
    # fn[r, j * d + c]: the flattened streams' column of channel c of stream j
    f = tl.load(fn_ptr + r[:, None, None] * stride_fr + j[None, :, None] * d + cols[None, None, :],
                mask=(r < rows)[:, None, None] & ok[None, :, :], other=0.0)
    dots = tl.sum(tl.sum(f * s[None, :, :], axis=2), axis=1)  # [R]
    sq = tl.sum(tl.sum(s * s, axis=1), axis=0)
    dots = tl.where(r == rows, sq, dots)
    tl.store(part_ptr + (tok * num_slices + sl) * (rows + 2) + r, dots, mask=r <= rows)


@triton.jit(do_not_specialize=["iters"])
def _hc_finish_kernel(part_ptr, s_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, x_ptr,
                      m, d, rows, num_slices, iters, hc_eps, norm_eps,
                      stride_sn, stride_sr, stride_xn,
                      HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    tok = tl.program_id(0).to(tl.int64)
    sl_id = tl.program_id(1)
    sl = tl.arange(0, BLOCK_S)
    ok_s = sl < num_slices
    part = part_ptr + tok * num_slices * (rows + 2) + sl * (rows + 2)  # [S] row starts
    sq = tl.sum(tl.load(part + rows, mask=ok_s, other=0.0), axis=0)
    inv = 1.0 / tl.sqrt(sq / (m * d) + norm_eps)
    j = tl.arange(0, BLOCK_M)
    ok_m = j < m
    pre = tl.sum(tl.load(part[:, None] + j[None, :], mask=ok_s[:, None] & ok_m[None, :], other=0.0),
                 axis=0) * inv
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + j, mask=ok_m, other=0.0)) + hc_eps
    pre = tl.where(ok_m, pre, 0.0)
    if not HEAD:
        post = tl.sum(tl.load(part[:, None] + m + j[None, :], mask=ok_s[:, None] & ok_m[None, :],
                              other=0.0), axis=0) * inv
        post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1)
                                + tl.load(base_ptr + m + j, mask=ok_m, other=0.0))
        if sl_id == 0:
            tl.store(post_ptr + tok * m + j, post, mask=ok_m)
        ok_c = ok_m[:, None] & ok_m[None, :]
        cidx = 2 * m + j[:, None] * m + j[None, :]  # [M(i), M(k)] row of fn / base
        c = tl.sum(tl.load(part[:, None, None] + cidx[None, :, :],
                           mask=ok_s[:, None, None] & ok_c[None, :, :], other=0.0), axis=0) * inv
        c = c * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx, mask=ok_c, other=0.0)
        # Sinkhorn as kernels.sinkhorn: row softmax + eps, column-normalised, iters - 1 rounds
        c = tl.where(ok_c, c, -1e30)  # finite: padded rows stay NaN-free
        e = tl.where(ok_c, tl.exp(c - tl.max(c, axis=1)[:, None]), 0.0)
        c = tl.where(ok_c, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        if sl_id == 0:
            tl.store(comb_ptr + tok * m * m + j[:, None] * m + j[None, :], c, mask=ok_c)
    # this slice of the collapse, rounded to the streams' dtype as the reference, and its
    # share of the RMSNorm's sum of squares (the norm itself: _hc_norm_kernel)
    cols = sl_id * BLOCK_D + tl.arange(0, BLOCK_D)
    ok_d = cols < d
    s = tl.load(s_ptr + tok * stride_sn + j[:, None] * stride_sr + cols[None, :],
                mask=ok_m[:, None] & ok_d[None, :], other=0.0).to(tl.float32)
    col = tl.sum(pre[:, None] * s, axis=0).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + tok * stride_xn + cols, col, mask=ok_d)
    colf = col.to(tl.float32)
    tl.store(part_ptr + (tok * num_slices + sl_id) * (rows + 2) + rows + 1,
             tl.sum(colf * colf, axis=0))


@triton.jit
def _hc_norm_kernel(part_ptr, w_ptr, x_ptr, d, rows, num_slices, norm_eps, stride_xn,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    tok = tl.program_id(0).to(tl.int64)
    sl = tl.arange(0, BLOCK_S)
    sq = tl.sum(tl.load(part_ptr + (tok * num_slices + sl) * (rows + 2) + rows + 1,
                        mask=sl < num_slices, other=0.0), axis=0)
    rn = 1.0 / tl.sqrt(sq / d + norm_eps)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < d
    x = tl.load(x_ptr + tok * stride_xn + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(x_ptr + tok * stride_xn + cols, (x * rn * w).to(x_ptr.dtype.element_ty), mask=ok)


def num_slices(d: int) -> int:
    """Hidden-dim slices of the mix pass (the partials' middle dim)."""
    return cdiv(d, HC_MIX_BLOCK_D)


def hc_decode_warps(n: int) -> tuple[int, int, int]:
    """num_warps of the mix, finish and norm launches for ``n`` tokens. The finish runs its
    Sinkhorn rounds on one warp: with more, each of its ~40 tiny reductions crosses warps
    through shared memory. H100, the three launches of a boundary from a CUDA graph
    (``lab.bench.deepseek_v4.hc_decode_warps``, lab/results/notebook.md "Fourteenth session"): one
    token 9.26 -> 8.03 us at (4, 1, 2); 8 and 32 tokens 13.54 -> 10.28 and 37.07 -> 19.31 us
    at (2, 1, 1), which is 1 us slower than (4, 1, 2) at one token."""
    return (4, 1, 2) if n <= 1 else (2, 1, 1)


def launch_hc_decode(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor, norm_weight: torch.Tensor, iters: int, hc_eps: float,
                     norm_eps: float, partial: torch.Tensor, merge: tuple | None,
                     merged: torch.Tensor | None, post: torch.Tensor | None,
                     comb: torch.Tensor | None, x: torch.Tensor, head: bool,
                     warps: tuple[int, int, int] | None = None) -> None:
    """``warps``: num_warps of the mix, finish and norm launches (default
    :func:`hc_decode_warps`)."""
    n, m, d = streams.shape
    mix_w, finish_w, norm_w = warps or hc_decode_warps(n)
    rows = fn.shape[0]
    ns = num_slices(d)
    bm = max(2, next_pow2(m))
    pdl = pdl_kwargs(streams.device)
    if merge is not None:
        p0, c0, bo = merge
        _hc_mix_kernel[(n, ns)](
            streams, fn, partial, p0, c0, bo, merged, m, d, rows, ns,
            streams.stride(0), streams.stride(1), fn.stride(0), bo.stride(0), merged.stride(0),
            merged.stride(1), MERGE=True, F32=streams.dtype == torch.float32, BLOCK_M=bm,
            BLOCK_R=next_pow2(rows + 1), BLOCK_D=HC_MIX_BLOCK_D, num_warps=mix_w, **pdl,
        )
        src = merged
    else:
        _hc_mix_kernel[(n, ns)](
            streams, fn, partial, partial, partial, partial, partial, m, d, rows, ns,
            streams.stride(0), streams.stride(1), fn.stride(0), 0, 0, 0,
            MERGE=False, F32=True, BLOCK_M=bm, BLOCK_R=next_pow2(rows + 1),
            BLOCK_D=HC_MIX_BLOCK_D, num_warps=mix_w, **pdl,
        )
        src = streams
    bs = max(2, next_pow2(ns))
    _hc_finish_kernel[(n, ns)](
        partial, src, base, scale, partial if post is None else post,
        partial if comb is None else comb, x, m, d, rows, ns, iters, hc_eps, norm_eps,
        src.stride(0), src.stride(1), x.stride(0), HEAD=head, BLOCK_M=bm, BLOCK_S=bs,
        BLOCK_D=HC_MIX_BLOCK_D, num_warps=finish_w, **pdl,
    )
    _hc_norm_kernel[(n, ns)](partial, norm_weight, x, d, rows, ns, norm_eps, x.stride(0),
                             BLOCK_S=bs, BLOCK_D=HC_MIX_BLOCK_D, num_warps=norm_w, **pdl)
