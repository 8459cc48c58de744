"""Triton kernels of ``kernels.hc_streams``: one program per (token, slice of the hidden dim),
the m x m mixing matrix and the m stream rows of the slice in registers. Nothing allocates."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_support import cdiv, next_pow2

HC_BLOCK_D = 512  # hidden channels per program: m x 512 stream values in registers


@triton.jit
def _hc_merge_kernel(post_ptr, comb_ptr, bo_ptr, s_ptr, out_ptr, m, d,
                     stride_pn, stride_cn, stride_cr, stride_bn, stride_sn, stride_sr,
                     stride_on, stride_or,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    ok_m = j < m
    ok_d = cols < d
    s = tl.load(s_ptr + tok * stride_sn + j[:, None] * stride_sr + cols[None, :],
                mask=ok_m[:, None] & ok_d[None, :], other=0.0).to(tl.float32)  # [M(j), D]
    bo = tl.load(bo_ptr + tok * stride_bn + cols, mask=ok_d, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + tok * stride_pn + j, mask=ok_m, other=0.0)
    # comb[j, i] -> rows j, columns i; the reference rounds post and comb to the streams' dtype
    comb = tl.load(comb_ptr + tok * stride_cn + j[:, None] * stride_cr + j[None, :],
                   mask=ok_m[:, None] & ok_m[None, :], other=0.0)
    if not F32:
        post = post.to(out_ptr.dtype.element_ty).to(tl.float32)
        comb = comb.to(out_ptr.dtype.element_ty).to(tl.float32)
    # out[i, :] = post[i] * bo + sum_j comb[j, i] * s[j, :]
    mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)  # [M(i), D]
    out = post[:, None] * bo[None, :] + mixed
    tl.store(out_ptr + tok * stride_on + j[:, None] * stride_or + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok_m[:, None] & ok_d[None, :])


@triton.jit
def _hc_collapse_kernel(pre_ptr, s_ptr, out_ptr, m, d, stride_pn, stride_sn, stride_sr,
                        stride_on, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    ok_m = j < m
    ok_d = cols < d
    s = tl.load(s_ptr + tok * stride_sn + j[:, None] * stride_sr + cols[None, :],
                mask=ok_m[:, None] & ok_d[None, :], other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + tok * stride_pn + j, mask=ok_m, other=0.0)
    out = tl.sum(pre[:, None] * s, axis=0)
    tl.store(out_ptr + tok * stride_on + cols, out.to(out_ptr.dtype.element_ty), mask=ok_d)


def _grid(n: int, d: int, m: int) -> tuple[tuple[int, int], int, int]:
    block_d = min(HC_BLOCK_D, next_pow2(d))
    return (n, cdiv(d, block_d)), max(2, next_pow2(m)), block_d


def launch_hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
                    streams: torch.Tensor, out: torch.Tensor) -> None:
    n, m, d = streams.shape
    grid, bm, bd = _grid(n, d, m)
    _hc_merge_kernel[grid](
        post, comb, block_out, streams, out, m, d, post.stride(0), comb.stride(0), comb.stride(1),
        block_out.stride(0), streams.stride(0), streams.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_D=bd, F32=streams.dtype == torch.float32, num_warps=4,
    )


def launch_hc_collapse(pre: torch.Tensor, streams: torch.Tensor, out: torch.Tensor) -> None:
    n, m, d = streams.shape
    grid, bm, bd = _grid(n, d, m)
    _hc_collapse_kernel[grid](
        pre, streams, out, m, d, pre.stride(0), streams.stride(0), streams.stride(1),
        out.stride(0), BLOCK_M=bm, BLOCK_D=bd, num_warps=4,
    )
