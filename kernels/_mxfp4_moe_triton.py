"""Triton kernels of the MXFP4 routed experts (see ``kernels.mxfp4_moe``).

The (token, choice) pairs arrive sorted by expert (``order``: sorted position -> pair index) with
``row_end [E]``, the inclusive end of each expert's run of rows. Every program finds its expert
and row tile from ``row_end`` by itself (a cumulative sum of per-expert tile counts), so one
launch covers every expert with a grid sized by tokens x top-k, nothing is read back to the host,
and experts with no rows cost nothing. Weights are decoded tile by tile from bytes (e2m1 through
an fp16 bitcast, e8m0 through an fp32 bitcast): no fp4/fp8 dtype, no Hopper-only instruction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._fp8_linear_triton import dot_nt
from kernels._triton_support import interpreting, next_pow2


@triton.jit
def _expert_tile(row_end_ptr, t, E, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    """Tile ``t`` of the expert-sorted rows -> (expert, is_valid, first row, end row)."""
    ids = tl.arange(0, E_P2)
    ok = ids < E
    end = tl.load(row_end_ptr + ids, mask=ok, other=0)
    start = tl.load(row_end_ptr + ids - 1, mask=ok & (ids > 0), other=0)
    end = tl.where(ok, end, 0)
    start = tl.where(ok, start, 0)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    tile_end = tl.where(ok, tile_end, 2147483647)
    e = tl.sum((tile_end <= t).to(tl.int32), 0)
    here = ids == e
    first_tile = tl.sum(tl.where(here, tile_end - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, start, 0), 0) + (t - first_tile) * BLOCK_M
    return e, e < E, row0, tl.sum(tl.where(here, end, 0), 0)


@triton.jit
def _mxfp4_tile(w_rows, s_rows, k, mask):
    """Rows of packed e2m1 bytes (``w_rows`` [BN, 1] pointers) and their e8m0 scales at
    columns ``k`` [BK] -> fp32 [BN, BK]."""
    b = tl.load(w_rows + (k // 2)[None, :], mask=mask, other=0).to(tl.int32)
    nib = (b >> ((k % 2) * 4)[None, :]) & 0xF
    bits = ((nib & 8) << 12) | ((nib & 7) << 9)  # sign, then exponent+mantissa into fp16
    v = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0
    sc = tl.load(s_rows + (k // 32)[None, :], mask=mask, other=127).to(tl.int32)
    return v * (sc << 23).to(tl.float32, bitcast=True)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, order_ptr, row_end_ptr, w_ptr, s_ptr, h_ptr,
    E, H, INTER, TOP_K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
    limit,
    F32: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[row, n] = swiglu(x[token] @ gate[e, n]^T, x[token] @ up[e, n]^T) for sorted rows."""
    e, valid, row0, row_end = _expert_tile(row_end_ptr, tl.program_id(0), E, BLOCK_M, E_P2)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_end
        tok = tl.load(order_ptr + rows, mask=r_ok, other=0) // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        wg = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn
        sg = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < H
            x = tl.load(x_ptr + tok[:, None] * stride_xm + k[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = n_ok[:, None] & k_ok[None, :]
            acc_g += dot_nt(x, _mxfp4_tile(wg, sg, k, wmask), F32)
            acc_u += dot_nt(x, _mxfp4_tile(wg + INTER * stride_wn, sg + INTER * stride_sn, k, wmask), F32)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + rows[:, None] * stride_hm + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, order_ptr, row_end_ptr, tw_ptr, w_ptr, s_ptr, y_ptr,
    E, H, INTER,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    F32: tl.constexpr, E_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[pair, n] = routing weight[pair] * (h[row] @ down[e, n]^T), stored at the pair's
    unsorted index so the combine reads each token's top-k rows contiguously."""
    e, valid, row0, row_end = _expert_tile(row_end_ptr, tl.program_id(0), E, BLOCK_M, E_P2)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_end
        pair = tl.load(order_ptr + rows, mask=r_ok, other=0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        wd = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn
        sd = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < INTER
            a = tl.load(h_ptr + rows[:, None] * stride_hm + k[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += dot_nt(a, _mxfp4_tile(wd, sd, k, n_ok[:, None] & k_ok[None, :]), F32)
        tw = tl.load(tw_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + pair[:, None] * stride_ym + n[None, :],
                 (acc * tw[:, None]).to(y_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, out_ptr, H, TOP_K, stride_ym, stride_om,
                        ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] (+)= sum_j y[t * TOP_K + j] in fp32, in a fixed order (deterministic)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    o = out_ptr + t.to(tl.int64) * stride_om + cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if ACCUMULATE:
        acc += tl.load(o, mask=ok, other=0.0).to(tl.float32)
    for j in range(0, TOP_K):
        acc += tl.load(y_ptr + (t.to(tl.int64) * TOP_K + j) * stride_ym + cols, mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_tiles(num_pairs: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode steps have a few rows per expert."""
    if num_pairs <= 256:
        return 16, 64, 64, 4
    return 64, 64, 64, 4


def launch_moe(x: torch.Tensor, order: torch.Tensor, row_end: torch.Tensor, tw: torch.Tensor,
               gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
               down_scale: torch.Tensor, limit: float, h: torch.Tensor, y: torch.Tensor,
               out: torch.Tensor, top_k: int, accumulate: bool) -> None:
    t, hid = x.shape
    e, inter = gate_up.shape[0], down.shape[-1] * 2
    m = t * top_k
    bm, bn, bk, warps = moe_tiles(m)
    # every non-empty expert owns >= 1 row, so the tiles are at most min(pairs, ...) in number
    max_tiles = min(m, triton.cdiv(m, bm) + e - 1)
    f32 = x.dtype == torch.float32 or interpreting()
    ep2 = next_pow2(e)
    _moe_gate_up_kernel[(max_tiles, triton.cdiv(inter, bn))](
        x, order, row_end, gate_up, gate_up_scale, h, e, hid, inter, top_k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), h.stride(0), float(limit),
        F32=f32, E_P2=ep2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    _moe_down_kernel[(max_tiles, triton.cdiv(hid, bn))](
        h, order, row_end, tw, down, down_scale, y, e, hid, inter,
        h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        y.stride(0), F32=f32, E_P2=ep2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    block = min(1024, next_pow2(hid))
    _moe_combine_kernel[(t, triton.cdiv(hid, block))](
        y, out, hid, top_k, y.stride(0), out.stride(0), ACCUMULATE=accumulate, BLOCK=block)
