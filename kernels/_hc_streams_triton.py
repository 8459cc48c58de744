"""Triton kernels of ``kernels.hc_streams``. Merge and collapse: one program per (token, slice
of the hidden dim), the m x m mixing matrix and the m stream rows of the slice in registers.
Mixes: one program per tile of tokens, looping over the flattened streams. Nothing allocates."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton_support import cdiv, interpreting, next_pow2

# hidden channels per merge/collapse program: m x 1024 stream values in registers. H100, 4 x 4096
# bf16 streams (lab.bench.deepseek_v4.hc_sweep, 2026-12-06): collapse 0.064 against 0.165 ms at 512
# (4096 tokens), 0.118 against 0.306 (8192); merge 0.113 against 0.121, 0.218 against 0.235
HC_BLOCK_D = 1024
HC_MIX_BLOCK_N = 16  # tokens per mixes program (tl.dot's least M): 256 programs at 4096 tokens
# from HC_MIX_WIDE_FROM tokens, 64 a program: fewer programs re-read the mixing weights (H100:
# 0.223 against 0.247 ms at 4096 tokens, 0.217 against 0.417 at 8192)
HC_MIX_BLOCK_N_WIDE = 64
HC_MIX_WIDE_FROM = 4096
HC_MIX_BLOCK_K = 64  # stream channels per step of the mixes' loop


@triton.jit
def _stream_tile(s_ptr, m, d, stride_sn, stride_sr, BLOCK_M: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """This program's token and ``BLOCK_D`` columns -> (token, columns, stream ids, stream
    mask, column mask, the token's ``m`` streams at those columns in fp32 [BLOCK_M, BLOCK_D])."""
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    ok_m = j < m
    ok_d = cols < d
    s = tl.load(s_ptr + tok * stride_sn + j[:, None] * stride_sr + cols[None, :],
                mask=ok_m[:, None] & ok_d[None, :], other=0.0).to(tl.float32)
    return tok, cols, j, ok_m, ok_d, s


@triton.jit
def _hc_merge_kernel(post_ptr, comb_ptr, bo_ptr, s_ptr, out_ptr, m, d,
                     stride_pn, stride_cn, stride_cr, stride_bn, stride_sn, stride_sr,
                     stride_on, stride_or,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr):
    tok, cols, j, ok_m, ok_d, s = _stream_tile(s_ptr, m, d, stride_sn, stride_sr, BLOCK_M,
                                               BLOCK_D)  # s: [M(j), D]
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
    tok, cols, j, ok_m, ok_d, s = _stream_tile(s_ptr, m, d, stride_sn, stride_sr, BLOCK_M,
                                               BLOCK_D)
    pre = tl.load(pre_ptr + tok * stride_pn + j, mask=ok_m, other=0.0)
    out = tl.sum(pre[:, None] * s, axis=0)
    tl.store(out_ptr + tok * stride_on + cols, out.to(out_ptr.dtype.element_ty), mask=ok_d)


@triton.jit
def _hc_mixes_kernel(s_ptr, fn_ptr, out_ptr, n, m, d, rows, eps, stride_sn, stride_sr, stride_fr,
                     stride_on, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT3: tl.constexpr = False):
    """SPLIT3 (bf16 streams on a GPU): the fp32 weights as the sum of three bf16 parts (8
    significand bits each: all 24 of fp32), each on the tensor cores against the bf16 streams.
    The products are exact, but the tensor cores' fp32 accumulation is not IEEE: an H100
    measured 5.5e-5 relative error against the fp64 product (TF32 2.9e-4, an fp32 cuBLAS GEMM
    without TF32 ~1e-7), at 0.26 ms a 4096-token call on the H200. Else an IEEE fp32 dot, which
    runs on the CUDA cores (an H100 measured 1.1 ms a 4096-token chunk that way)."""
    toks = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    ck = tl.arange(0, BLOCK_K)
    ok_n = toks < n
    ok_r = r < rows
    s_rows = s_ptr + toks.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, m):  # stream j is columns j * d .. (j + 1) * d of fn
        for c0 in range(0, d, BLOCK_K):
            cols = c0 + ck
            ok_k = cols < d
            xs = tl.load(s_rows + j * stride_sr + cols[None, :],
                         mask=ok_n[:, None] & ok_k[None, :], other=0.0)  # [N, K]
            w = tl.load(fn_ptr + r[None, :] * stride_fr + (j * d + cols)[:, None],
                        mask=ok_k[:, None] & ok_r[None, :], other=0.0)  # [K, R]
            x = xs.to(tl.float32)
            if SPLIT3:
                w1 = w.to(tl.bfloat16)
                r1 = w - w1.to(tl.float32)
                w2 = r1.to(tl.bfloat16)
                w3 = (r1 - w2.to(tl.float32)).to(tl.bfloat16)
                acc = tl.dot(xs, w1, acc)
                acc = tl.dot(xs, w2, acc)
                acc = tl.dot(xs, w3, acc)
            else:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            sq += tl.sum(x * x, axis=1)
    out = acc * tl.rsqrt(sq / (m * d) + eps)[:, None]
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * stride_on + r[None, :], out,
             mask=ok_n[:, None] & ok_r[None, :])


def _grid(n: int, d: int, m: int, block_d: int) -> tuple[tuple[int, int], int, int]:
    block_d = min(block_d, next_pow2(d))
    return (n, cdiv(d, block_d)), max(2, next_pow2(m)), block_d


# (BLOCK_D, num_warps) of merge and collapse; (BLOCK_N, BLOCK_K, num_warps, num_stages) of the
# mixes: benchmarks pass others (``lab.bench.deepseek_v4.hc_sweep``)
HcTiles = tuple[int, ...]


def launch_hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
                    streams: torch.Tensor, out: torch.Tensor, tiles: HcTiles | None = None) -> None:
    n, m, d = streams.shape
    block_d, warps = tiles or (HC_BLOCK_D, 4)
    grid, bm, bd = _grid(n, d, m, block_d)
    _hc_merge_kernel[grid](
        post, comb, block_out, streams, out, m, d, post.stride(0), comb.stride(0), comb.stride(1),
        block_out.stride(0), streams.stride(0), streams.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_D=bd, F32=streams.dtype == torch.float32, num_warps=warps,
    )


def launch_hc_collapse(pre: torch.Tensor, streams: torch.Tensor, out: torch.Tensor,
                       tiles: HcTiles | None = None) -> None:
    n, m, d = streams.shape
    block_d, warps = tiles or (HC_BLOCK_D, 4)
    grid, bm, bd = _grid(n, d, m, block_d)
    _hc_collapse_kernel[grid](
        pre, streams, out, m, d, pre.stride(0), streams.stride(0), streams.stride(1),
        out.stride(0), BLOCK_M=bm, BLOCK_D=bd, num_warps=warps,
    )


def launch_hc_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float, out: torch.Tensor,
                    tiles: HcTiles | None = None) -> None:
    n, m, d = streams.shape
    rows = fn.shape[0]
    block_n, block_k, warps, stages = tiles or (
        HC_MIX_BLOCK_N_WIDE if n >= HC_MIX_WIDE_FROM else HC_MIX_BLOCK_N, HC_MIX_BLOCK_K, 4, 3)
    _hc_mixes_kernel[(cdiv(n, block_n),)](
        streams, fn, out, n, m, d, rows, eps, streams.stride(0), streams.stride(1), fn.stride(0),
        out.stride(0), BLOCK_N=block_n, BLOCK_R=max(16, next_pow2(rows)),
        BLOCK_K=block_k, SPLIT3=streams.dtype == torch.bfloat16 and not interpreting(),
        num_warps=warps, num_stages=stages,
    )
