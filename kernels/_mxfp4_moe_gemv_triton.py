"""The per-pair GEMV form of the MXFP4 MoE (tiles with ``BLOCK_M`` 1; see ``_mxfp4_moe_triton``):
a decode step's few (token, expert) pairs, no sort and no MMA. Each program reads its pair's
expert straight from ``ids``, decodes a weight tile (``_mxfp4_weights_triton``) and reduces it
against the token's row; gate-up, (the split's SwiGLU), down and the combine, with the same
scratch and split-K layout as the tiled form (``_moe_split_k_triton``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._moe_split_k_triton import (
    _k_slice,
    _moe_combine_kernel,
    _moe_swiglu_split_kernel,
    split_k_slices,
)
from kernels._mxfp4_weights_triton import _as_words, _mxfp4_tile, _nibble_pair
from kernels._pdl_triton import l2_prefetch, pdl_wait
from kernels._triton_support import PDL_PREFETCH, next_pow2, pdl_kwargs


@triton.jit
def _gemv_words(w_rows, n_ok, kw, w_ok, a_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Unscaled partial dots [BN, BK/8]: for each int32 word of ``BLOCK_N`` rows (``w_rows`` [BN,
    1] int32 row pointers) at word columns ``kw`` [BK/8], the sum of its 8 values times the
    activations at ``a_ptr`` (columns 8w..8w+7). No interleave: column order is nibble order.
    The activations are read unpredicated, a word past the end at column 0 (its weights are
    masked to 0, so that value never counts unless it is infinite, when the row's sum is not
    finite anyway), and each product is added to the running sum on its own: one fused
    multiply-add a value. sm_90 SASS of the gate-up loop (16 x 256, 2 warps): 696
    instructions a K-tile against 816 before."""
    wd = tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & w_ok[None, :], other=0)
    a = a_ptr + tl.where(w_ok, kw, 0) * 8
    lo, hi = _nibble_pair(wd, 0)
    part = lo * tl.load(a).to(tl.float32)[None, :]
    part += hi * tl.load(a + 4).to(tl.float32)[None, :]
    for j in tl.static_range(1, 4):
        lo, hi = _nibble_pair(wd, j)
        part += lo * tl.load(a + j).to(tl.float32)[None, :]
        part += hi * tl.load(a + (j + 4)).to(tl.float32)[None, :]
    return part



@triton.jit
def _scale_groups(part, s_rows, kg, n_ok, K_GROUPS, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Partial dots per word [BN, BK/8] -> [BN]: summed per 32-column group (4 words), times
    the group's e8m0 scale (and fp16's 2**14 back), summed over groups."""
    sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_GROUPS)[None, :],
                 other=127).to(tl.int32)
    f = (sc << 23).to(tl.float32, bitcast=True) * 16384.0
    g = tl.sum(part.reshape(BLOCK_N, BLOCK_K // 32, 4), 2)
    return tl.sum(g * f, 1)



@triton.jit
def _gemv_acc(acc, w_rows, s_rows, a_ptr, k0, k_hi, n_ok, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
    """acc [BN] + the K-tile at ``k0`` (columns below ``k_hi``) of ``BLOCK_N`` MXFP4 rows dotted
    with the activation row at ``a_ptr``. WORDS: ``w_rows`` point at int32 words, decoded two
    values an op (:func:`_nibble_pair`), the scale applied once per 32-column group; else
    ``w_rows`` point at bytes and each value is decoded and scaled (:func:`_mxfp4_tile`)."""
    if WORDS:
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        part = _gemv_words(w_rows, n_ok, kw, kw < k_hi // 8, a_ptr, BLOCK_N, BLOCK_K)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        acc += _scale_groups(part, s_rows, kg, n_ok, k_hi // 32, BLOCK_N, BLOCK_K)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        a = tl.load(a_ptr + k, mask=k < k_hi, other=0.0).to(tl.float32)
        acc += tl.sum(_mxfp4_tile(w_rows, s_rows, kb, kg, n_ok, k_hi // 2, BLOCK_N, BLOCK_K)
                      * a[None, :], 1)
    return acc



@triton.jit
def _prefetch_expert_rows(rows_ptr, stride_wn, rows, k_lo, k_hi, BLOCK_N: tl.constexpr,
                          WORDS: tl.constexpr):
    """``PDL`` bit 4 of the per-pair GEMVs: ask L2 at once for the packed bytes of columns
    [k_lo, k_hi) of the first ``rows`` rows at ``rows_ptr`` (row stride ``stride_wn``, in the
    pointer's elements: bytes, or int32 words with ``WORDS``), so every load of the K loop is
    in flight from the start. The launcher sets the bit only where the byte offsets and
    lengths are multiples of 16 (the bulk prefetch's rule)."""
    off = k_lo // 2
    if WORDS:
        off = k_lo // 8
    for r in tl.static_range(BLOCK_N):
        if r < rows:
            l2_prefetch(rows_ptr + r * stride_wn + off, (k_hi - k_lo) // 2)



@triton.jit
def _moe_gemv_gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, H, INTER, TOP_K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm, limit, SPLIT_TILES,
    stride_ps, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WORDS: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """The per-pair GEMV form of :func:`_moe_gate_up_kernel` (decode: a handful of pairs). Grid
    (pairs, N-tiles, K-slices); each program reads its pair's expert straight from ``ids`` (no
    sort), decodes a [BLOCK_N, BLOCK_K] weight tile and reduces it against the token's row
    with a broadcast multiply (no MMA, no rows padded to a tile). Writes ``h[pair]`` (pair
    order) or, ``PARTIAL``, the slice's fp32 gate and up sums as the tiled form does.
    ``WORDS``: ``w_ptr`` and its strides are in int32 words (see :func:`_gemv_acc`)."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair)
    tok = pair // TOP_K
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    wg = w_ptr + e * stride_we + n[:, None] * stride_wn
    sg = s_ptr + e * stride_se + n[:, None] * stride_sn
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a_ptr = x_ptr + tok * stride_xm
    k_lo, k_hi = _k_slice(H, SPLIT_TILES, BLOCK_K, PARTIAL)
    if PDL & 4:  # (the expert is known only now, after the wait)
        rows = tl.minimum(INTER - tl.program_id(1) * BLOCK_N, BLOCK_N)
        g0 = w_ptr + e * stride_we + tl.program_id(1) * BLOCK_N * stride_wn
        _prefetch_expert_rows(g0, stride_wn, rows, k_lo, k_hi, BLOCK_N, WORDS)
        _prefetch_expert_rows(g0 + INTER * stride_wn, stride_wn, rows, k_lo, k_hi, BLOCK_N, WORDS)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc_g = _gemv_acc(acc_g, wg, sg, a_ptr, k0, k_hi, n_ok, BLOCK_N, BLOCK_K, WORDS)
        acc_u = _gemv_acc(acc_u, wg + INTER * stride_wn, sg + INTER * stride_sn, a_ptr, k0, k_hi,
                          n_ok, BLOCK_N, BLOCK_K, WORDS)
    if PARTIAL:
        p = h_ptr + tl.program_id(2) * stride_ps + pair * stride_hm + n
        tl.store(p, acc_g, mask=n_ok)
        tl.store(p + INTER, acc_u, mask=n_ok)
    else:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        tl.store(h_ptr + pair * stride_hm + n, (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty),
                 mask=n_ok)



@triton.jit
def _moe_gemv_down_kernel(
    h_ptr, ids_ptr, tw_ptr, w_ptr, s_ptr, y_ptr, H, INTER,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_ym, SPLIT_TILES, stride_ys,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WORDS: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """The per-pair GEMV form of :func:`_moe_down_kernel`: y[pair] = weight[pair] * (h[pair] @
    down[e]^T), or with ``SPLIT`` the slice's weighted partial at ``y + slice * stride_ys``."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    wd = w_ptr + e * stride_we + n[:, None] * stride_wn
    sd = s_ptr + e * stride_se + n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_lo, k_hi = _k_slice(INTER, SPLIT_TILES, BLOCK_K, SPLIT)
    if PDL & 4:  # (the expert is known only now, after the wait)
        _prefetch_expert_rows(w_ptr + e * stride_we + tl.program_id(1) * BLOCK_N * stride_wn,
                              stride_wn, tl.minimum(H - tl.program_id(1) * BLOCK_N, BLOCK_N),
                              k_lo, k_hi, BLOCK_N, WORDS)
    if SPLIT:
        y_ptr += tl.program_id(2) * stride_ys
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc = _gemv_acc(acc, wd, sd, h_ptr + pair * stride_hm, k0, k_hi, n_ok, BLOCK_N, BLOCK_K,
                        WORDS)
    tw = tl.load(tw_ptr + pair).to(tl.float32)
    tl.store(y_ptr + pair * stride_ym + n, (acc * tw).to(y_ptr.dtype.element_ty), mask=n_ok)



def _prefetchable(gate_up: torch.Tensor, down: torch.Tensor, block_k: int) -> bool:
    """Whether the per-pair GEMVs' L2 prefetch (``PDL`` bit 4) may run: every row segment it
    asks for starts and ends on a 16-byte multiple (K-tiles of 32+ values, row strides, bases)."""
    return block_k % 32 == 0 and all(
        w.shape[-1] % 16 == 0 and w.data_ptr() % 16 == 0
        and all(st % 16 == 0 for st in w.stride()[:-1]) for w in (gate_up, down))



def _launch_moe_gemv(x: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, gate_up: torch.Tensor,
                     gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                     limit: float, h: torch.Tensor, y: torch.Tensor, out: torch.Tensor,
                     top_k: int, accumulate: bool, tiles: tuple[int, int, int, int],
                     splits: tuple[int, int], gu_part: torch.Tensor | None,
                     words: bool = False,
                     before_combine: Callable[[], None] | None = None) -> None:
    """The per-pair GEMV form (tiles with ``BLOCK_M`` 1): no sort; gate-up, (the split's
    SwiGLU), down, (the combine), with the same scratch and split-K layout as the tiled form.
    ``words``: the weights are read as int32 words where their layout allows (``_as_words``)."""
    t, hid = x.shape
    inter = down.shape[-1] * 2
    m = t * top_k
    bn, bk, warps, stages = tiles
    pdl = pdl_kwargs(out.device)
    if pdl and not _prefetchable(gate_up, down, bk):
        pdl["PDL"] = int(pdl["PDL"]) & ~PDL_PREFETCH
    gu_w = _as_words(gate_up) if words else None
    dn_w = _as_words(down) if words else None
    if gu_w is None or dn_w is None or bk % 32:
        gu_w = dn_w = None
    gu_slices, gu_tiles = split_k_slices(hid, bk, splits[0])
    dst = h
    if gu_slices > 1:
        assert gu_part is not None and gu_part.dtype == torch.float32, "gate-up split scratch"
        dst = gu_part
    gu = gate_up if gu_w is None else gu_w
    _moe_gemv_gate_up_kernel[(m, triton.cdiv(inter, bn), gu_slices)](
        x, ids, gu, gate_up_scale, dst, hid, inter, top_k, x.stride(0), gu.stride(0),
        gu.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), dst.stride(-2),
        float(limit), gu_tiles, dst.stride(0) if gu_slices > 1 else 0, PARTIAL=gu_slices > 1,
        BLOCK_N=bn, BLOCK_K=bk, WORDS=gu_w is not None, num_warps=warps, num_stages=stages,
        **pdl)
    if gu_slices > 1:
        rb = min(1024, next_pow2(inter))
        _moe_swiglu_split_kernel[(m, triton.cdiv(inter, rb))](
            dst, h, inter, gu_slices, dst.stride(0), dst.stride(1), h.stride(0), float(limit),
            BLOCK=rb, **pdl)
    dn_slices, dn_tiles = split_k_slices(inter, bk, splits[1])
    if y.dim() == 3:
        assert y.dtype == torch.float32 and y.shape[0] >= dn_slices, (y.dtype, y.shape)
        if dn_slices == 1:
            y = y[0]
    else:
        assert dn_slices == 1, "a down split needs fp32 [slices, T * k, H] scratch as y"
    dn = down if dn_w is None else dn_w
    _moe_gemv_down_kernel[(m, triton.cdiv(hid, bn), dn_slices)](
        h, ids, tw, dn, down_scale, y, hid, inter, h.stride(0), dn.stride(0), dn.stride(1),
        down_scale.stride(0), down_scale.stride(1), y.stride(-2), dn_tiles,
        y.stride(0) if dn_slices > 1 else 0, SPLIT=dn_slices > 1, BLOCK_N=bn, BLOCK_K=bk,
        WORDS=dn_w is not None, num_warps=warps, num_stages=stages, **pdl)
    block = min(1024, next_pow2(hid))
    if before_combine is not None:
        before_combine()
    _moe_combine_kernel[(t, triton.cdiv(hid, block))](
        y, out, hid, top_k, y.stride(-2), out.stride(0), dn_slices,
        y.stride(0) if dn_slices > 1 else 0, ACCUMULATE=accumulate, BLOCK=block,
        **pdl)
