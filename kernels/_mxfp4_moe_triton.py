"""Triton kernels of the MXFP4 routed experts (see ``kernels.mxfp4_moe``).

A counting sort on the device (``_moe_row_end_kernel`` then ``_moe_order_kernel``) writes
``row_end [E]`` (inclusive end of each expert's run of rows) and ``order`` (sorted position ->
pair index) into the caller's workspace: no torch op, so no allocation and no host sync. Every
GEMM program finds its expert and row tile from ``row_end`` by itself (a cumulative sum of
per-expert tile counts), so one launch covers every expert with a grid sized by tokens x top-k,
and programs past the last touched expert's tile exit at once: only touched experts' weights
are read, each once per row tile.

Weights are decoded in registers (``_mxfp4_weights_triton``). Decode tiles (``BLOCK_M`` < 64, a few rows per expert) swap the
operands: the decoded weight tile is the dot's M side (wide, register-resident) and the few
token rows its N side, so a program streams ``BLOCK_N`` weight rows with no padding waste.

Beside this module: the tile choice (``_mxfp4_moe_tiles``), the per-pair GEMV form of a decode
step's few pairs (``_mxfp4_moe_gemv_triton``), split-K and the SwiGLU / combine epilogues
(``_moe_split_k_triton``), and the FP8 x FP8 GEMMs (``_mxfp4_moe_fp8_triton``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._moe_sort_triton import BLOCKED_SORT_MIN_PAIRS, _expert_tile, launch_tiled_sort
from kernels._moe_split_k_triton import (
    _k_slice,
    _moe_combine_kernel,
    _moe_swiglu_split_kernel,
    split_k_slices,
)
from kernels._mxfp4_moe_gemv_triton import _launch_moe_gemv
from kernels._mxfp4_moe_tiles import MoeTiles, moe_down_tiles, moe_tiles
from kernels._mxfp4_weights_triton import _as_words, _mx_acc
from kernels._triton_support import interpreting, next_pow2, pdl_kwargs

__all__ = ["MoeTiles", "launch_moe", "launch_moe_sort", "moe_down_tiles", "moe_tiles",
           "split_k_slices"]

_SORT_BLOCK = 128
_ORDER_BLOCK = 32



@triton.jit
def _moe_row_end_kernel(ids_ptr, row_end_ptr, M, E, BLOCK: tl.constexpr):
    """row_end[e] = number of pairs whose expert id is <= e."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cnt = tl.zeros((BLOCK,), dtype=tl.int32)
    for j0 in range(0, M, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        id_j = tl.load(ids_ptr + j, mask=j < M, other=2147483647).to(tl.int32)
        cnt += tl.sum((id_j[None, :] <= e[:, None]).to(tl.int32), 1)
    tl.store(row_end_ptr + e, cnt, mask=e < E)


@triton.jit
def _moe_order_kernel(ids_ptr, row_end_ptr, order_ptr, M, E, BLOCK: tl.constexpr,
                      BLOCK_J: tl.constexpr = 128):
    """order[start of expert id_i + #{j < i with id_j == id_i}] = i: a stable sort by expert.
    An id outside [0, E) (a caller bug the wrapper cannot see without a sync) is dropped rather
    than written out of bounds. A narrow ``BLOCK`` of i keeps the [BLOCK, BLOCK_J] compare tile
    small (occupancy) and the programs many (prefill has 24k pairs)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    id_i = tl.load(ids_ptr + i, mask=i < M, other=0).to(tl.int32)
    i_ok = (i < M) & (id_i >= 0) & (id_i < E)
    rank = tl.load(row_end_ptr + id_i - 1, mask=i_ok & (id_i > 0), other=0)
    for j0 in range(0, tl.program_id(0) * BLOCK + BLOCK, BLOCK_J):  # only j < i can count
        j = j0 + tl.arange(0, BLOCK_J)
        id_j = tl.load(ids_ptr + j, mask=j < M, other=-1).to(tl.int32)
        same = (id_j[None, :] == id_i[:, None]) & (j[None, :] < i[:, None])
        rank += tl.sum(same.to(tl.int32), 1)
    tl.store(order_ptr + rank, i.to(tl.int64), mask=i_ok)



@triton.jit
def _tile_ids(N_FIRST: tl.constexpr):
    """(row tile, N-tile) of this program. N_FIRST: grid axis 0 walks the N-tiles, so the
    programs in flight together share a row tile's gathered activations (read from HBM once,
    then from L2) and the expert's weights stay in L2 between its consecutive row tiles; else
    axis 0 walks the row tiles (every N-tile pass re-reads all the activations)."""
    if N_FIRST:
        t = tl.program_id(1)
        nt = tl.program_id(0)
    else:
        t = tl.program_id(0)
        nt = tl.program_id(1)
    return t, nt



@triton.jit
def _k_tile(k0, BLOCK_K: tl.constexpr):
    """Column offsets of the K-tile at ``k0``: values [BK], packed bytes [BK/2], scale groups
    [BK/32], int32 words [BK/8]."""
    k = k0 + tl.arange(0, BLOCK_K)
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return k, kb, kg, kw


@triton.jit
def _load_rows(base, rows, stride, k, r_ok, k_hi, SWAP: tl.constexpr):
    """Activations of ``rows`` (row stride ``stride``) at columns ``k`` below ``k_hi``: [BM, BK],
    or [BK, BM] with SWAP (the dot's second operand)."""
    a_ok = r_ok[:, None] & (k < k_hi)[None, :]
    if SWAP:
        a = tl.load(base + rows[None, :] * stride + k[:, None], mask=tl.trans(a_ok), other=0.0)
    else:
        a = tl.load(base + rows[:, None] * stride + k[None, :], mask=a_ok, other=0.0)
    return a


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, order_ptr, row_end_ptr, w_ptr, s_ptr, h_ptr,
    E, H, INTER, TOP_K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
    limit, SPLIT_TILES, stride_ps,
    F32: tl.constexpr, E_P2: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    SCALED: tl.constexpr = False, WORDS: tl.constexpr = False,
    N_FIRST: tl.constexpr = False,
):
    """h[row, n] = swiglu(x[token] @ gate[e, n]^T, x[token] @ up[e, n]^T) for sorted rows.
    Split-K (``PARTIAL``): grid axis 2 is a slice of ``SPLIT_TILES`` K-tiles of the hidden dim;
    its fp32 gate and up sums go to ``h + slice * stride_ps`` as a [rows, 2 * INTER] partial
    (gate columns, then up), and ``_moe_swiglu_split_kernel`` sums the slices and applies
    the SwiGLU (which needs whole sums)."""
    tile, n_tile = _tile_ids(N_FIRST)
    e, valid, row0, row_end = _expert_tile(row_end_ptr, tile, E, BLOCK_M, E_P2)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_end
        tok = tl.load(order_ptr + rows, mask=r_ok, other=0) // TOP_K
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        wg = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn
        sg = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        wu = wg + INTER * stride_wn
        su = sg + INTER * stride_sn
        if SWAP:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros_like(acc_g)
        k_lo, k_hi = _k_slice(H, SPLIT_TILES, BLOCK_K, PARTIAL)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k, kb, kg, kw = _k_tile(k0, BLOCK_K)
            a = _load_rows(x_ptr, tok, stride_xm, k, r_ok, k_hi, SWAP)
            acc_g = _mx_acc(acc_g, a, wg, sg, kb, kg, kw, n_ok, k_hi // 2, BLOCK_N, BLOCK_K,
                            SWAP, F32, SCALED, WORDS)
            acc_u = _mx_acc(acc_u, a, wu, su, kb, kg, kw, n_ok, k_hi // 2, BLOCK_N, BLOCK_K,
                            SWAP, F32, SCALED, WORDS)
        if PARTIAL:
            p = h_ptr + tl.program_id(2) * stride_ps
            if SWAP:
                p_at = p + rows[None, :] * stride_hm + n[:, None]
                p_ok = n_ok[:, None] & r_ok[None, :]
            else:
                p_at = p + rows[:, None] * stride_hm + n[None, :]
                p_ok = r_ok[:, None] & n_ok[None, :]
            tl.store(p_at, acc_g, mask=p_ok)
            tl.store(p_at + INTER, acc_u, mask=p_ok)
        else:
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
            if SWAP:
                tl.store(h_ptr + rows[None, :] * stride_hm + n[:, None], h,
                         mask=n_ok[:, None] & r_ok[None, :])
            else:
                tl.store(h_ptr + rows[:, None] * stride_hm + n[None, :], h,
                         mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, order_ptr, row_end_ptr, tw_ptr, w_ptr, s_ptr, y_ptr,
    E, H, INTER,
    stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_ym, SPLIT_TILES, stride_ys,
    F32: tl.constexpr, E_P2: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
    SCALED: tl.constexpr = False, WORDS: tl.constexpr = False,
    N_FIRST: tl.constexpr = False,
):
    """y[pair, n] = routing weight[pair] * (h[row] @ down[e, n]^T), stored at the pair's
    unsorted index so the combine reads each token's top-k rows contiguously. Split-K: grid
    axis 2 is a slice of ``SPLIT_TILES`` K-tiles of the intermediate dim, whose (weighted)
    partial goes to ``y + slice * stride_ys``; the combine sums the slices with the top-k."""
    tile, n_tile = _tile_ids(N_FIRST)
    e, valid, row0, row_end = _expert_tile(row_end_ptr, tile, E, BLOCK_M, E_P2)
    if valid:
        rows = row0 + tl.arange(0, BLOCK_M)
        r_ok = rows < row_end
        pair = tl.load(order_ptr + rows, mask=r_ok, other=0)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        wd = w_ptr + e.to(tl.int64) * stride_we + n[:, None] * stride_wn
        sd = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo, k_hi = _k_slice(INTER, SPLIT_TILES, BLOCK_K, SPLIT)
        if SPLIT:
            y_ptr += tl.program_id(2) * stride_ys
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k, kb, kg, kw = _k_tile(k0, BLOCK_K)
            a = _load_rows(h_ptr, rows, stride_hm, k, r_ok, k_hi, SWAP)
            acc = _mx_acc(acc, a, wd, sd, kb, kg, kw, n_ok, k_hi // 2, BLOCK_N, BLOCK_K, SWAP,
                          F32, SCALED, WORDS)
        tw = tl.load(tw_ptr + pair, mask=r_ok, other=0.0).to(tl.float32)
        if SWAP:
            tl.store(y_ptr + pair[None, :] * stride_ym + n[:, None],
                     (acc * tw[None, :]).to(y_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & r_ok[None, :])
        else:
            tl.store(y_ptr + pair[:, None] * stride_ym + n[None, :],
                     (acc * tw[:, None]).to(y_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & n_ok[None, :])


def launch_moe_sort(ids: torch.Tensor, order: torch.Tensor, row_end: torch.Tensor,
                    num_experts: int, counts: torch.Tensor | None = None) -> None:
    """ids [P] int64 -> row_end [E] int32 (pairs with expert <= e), order [P] int64 (stable).
    With ``counts`` (int32 scratch, ``_moe_sort_triton.sort_scratch_numel``) and a prefill-sized
    P, the tiled counting sort; else the all-pairs one."""
    m = ids.numel()
    if counts is not None and m >= BLOCKED_SORT_MIN_PAIRS:
        launch_tiled_sort(ids, order, row_end, counts, num_experts)
        return
    _moe_row_end_kernel[(triton.cdiv(num_experts, _SORT_BLOCK),)](
        ids, row_end, m, num_experts, BLOCK=_SORT_BLOCK)
    _moe_order_kernel[(triton.cdiv(m, _ORDER_BLOCK),)](
        ids, row_end, order, m, num_experts, BLOCK=_ORDER_BLOCK, BLOCK_J=_SORT_BLOCK)


def launch_moe(x: torch.Tensor, ids: torch.Tensor, order: torch.Tensor, row_end: torch.Tensor,
               tw: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
               down: torch.Tensor, down_scale: torch.Tensor, limit: float, h: torch.Tensor | None,
               y: torch.Tensor, out: torch.Tensor, top_k: int, accumulate: bool,
               tiles: MoeTiles | None = None,
               fp8_scratch: tuple[torch.Tensor, ...] | None = None,
               fp8_tiles: tuple[int, int, int, int, int] | None = None,
               sort_counts: torch.Tensor | None = None,
               down_tiles: MoeTiles | None = None,
               splits: tuple[int, int] = (1, 1), gu_part: torch.Tensor | None = None,
               before_combine: Callable[[], None] | None = None) -> None:
    """ids [T * k] expert per pair; order [T * k] int64 and row_end [E] int32 are written.
    ``fp8_scratch``: (token codes [T, H], their scales, SwiGLU codes [T * k, I], their scales)
    for the FP8 x FP8 GEMMs of ``_mxfp4_moe_fp8_triton`` (token codes already written); else
    ``h`` [T * k, I] holds the SwiGLU output of the weight-decoding GEMMs. ``tiles`` /
    ``fp8_tiles``: override the tile choice of either form (benchmarks sweep them).
    ``sort_counts``: the tiled sort's scratch (``launch_moe_sort``); None: the all-pairs sort.
    ``down_tiles``: the down GEMM's own tiles (None: those of the gate-up GEMM).
    ``splits``: (gate-up, down) split-K of the weight-decoding form, at most that many slices
    of whole K-tiles each (``split_k_slices``): gate-up partials go to ``gu_part`` fp32
    [>= slices, T * k, 2I]; with a down split asked for, ``y`` is fp32 [>= slices, T * k, H]
    (its first slice is the output when the K-tiles allow only one). ``before_combine``:
    called on the host right before the launch that reads ``out`` (the combine), e.g. to
    make the stream wait for another that writes it."""
    t, hid = x.shape
    e, inter = gate_up.shape[0], down.shape[-1] * 2
    m = t * top_k
    if tiles is None:
        tiles = moe_tiles(m, hid, gate_up.shape[0])
        down_tiles = down_tiles or moe_down_tiles(tiles)
    bm, bn, bk, warps, stages, *rest = tiles
    if bm == 1 and fp8_scratch is None:
        assert h is not None
        _launch_moe_gemv(x, ids, tw, gate_up, gate_up_scale, down, down_scale, limit, h, y, out,
                         top_k, accumulate, (bn, bk, warps, stages), splits, gu_part,
                         words=bool(rest[0]) if rest else False, before_combine=before_combine)
        return
    launch_moe_sort(ids, order, row_end, e, sort_counts)
    swap = bool(rest[0]) if rest else bm < 64
    scaled = len(rest) > 1 and bool(rest[1]) and x.dtype != torch.float32
    words = len(rest) > 2 and bool(rest[2]) and not scaled
    n_first = len(rest) > 3 and bool(rest[3])
    # every non-empty expert owns >= 1 row, so the tiles are at most min(pairs, ...) in number
    max_tiles = min(m, triton.cdiv(m, bm) + e - 1)
    f32 = x.dtype == torch.float32 or interpreting()
    ep2 = next_pow2(e)
    if fp8_scratch is not None:
        from kernels._mxfp4_moe_fp8_triton import fp8_moe_tiles, launch_moe_fp8_gemms

        xq, xs, hq, hs = fp8_scratch
        launch_moe_fp8_gemms(xq, xs, order, row_end, tw, gate_up, gate_up_scale, down,
                             down_scale, limit, hq, hs, y, top_k, ep2, not interpreting(),
                             fp8_tiles or fp8_moe_tiles(interpreting()))
    else:
        assert h is not None
        gu_slices, gu_tiles = split_k_slices(hid, bk, splits[0])
        dst = h
        if gu_slices > 1:
            assert gu_part is not None and gu_part.dtype == torch.float32, "gate-up split scratch"
            assert gu_part.shape[0] >= gu_slices and gu_part.shape[1:] == (m, 2 * inter)
            dst = gu_part
        gu = _as_words(gate_up) if words and bk % 32 == 0 else None
        gu = gate_up if gu is None else gu
        _moe_gate_up_kernel[_grid(max_tiles, triton.cdiv(inter, bn), gu_slices, n_first)](
            x, order, row_end, gu, gate_up_scale, dst, e, hid, inter, top_k,
            x.stride(0), gu.stride(0), gu.stride(1), gate_up_scale.stride(0),
            gate_up_scale.stride(1), dst.stride(-2), float(limit), gu_tiles,
            dst.stride(0) if gu_slices > 1 else 0,
            F32=f32, E_P2=ep2, PARTIAL=gu_slices > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            SWAP=swap, SCALED=scaled, WORDS=gu is not gate_up,
            N_FIRST=_n_first(max_tiles, n_first), num_warps=warps, num_stages=stages)
        if gu_slices > 1:
            rb = min(1024, next_pow2(inter))
            _moe_swiglu_split_kernel[(m, triton.cdiv(inter, rb))](
                dst, h, inter, gu_slices, dst.stride(0), dst.stride(1), h.stride(0),
                float(limit), BLOCK=rb, **pdl_kwargs(out.device))
        dbm, dbn, dbk, dwarps, dstages, *drest = down_tiles or (bm, bn, bk, warps, stages, swap,
                                                                scaled, words, n_first)
        dscaled = len(drest) > 1 and bool(drest[1]) and x.dtype != torch.float32
        dn = (_as_words(down) if len(drest) > 2 and bool(drest[2]) and not dscaled
              and dbk % 32 == 0 else None)
        dn = down if dn is None else dn
        dn_slices, dn_tiles = split_k_slices(inter, dbk, splits[1])
        if y.dim() == 3:  # scratch for a down split: fp32 [>= slices, T * k, H]
            assert y.dtype == torch.float32 and y.shape[0] >= dn_slices, (y.dtype, y.shape)
            if dn_slices == 1:  # asked for, but one K-tile: the first slice is the output
                y = y[0]
        else:
            assert dn_slices == 1, "a down split needs fp32 [slices, T * k, H] scratch as y"
        d_tiles = min(m, triton.cdiv(m, dbm) + e - 1)
        d_first = len(drest) > 3 and bool(drest[3])
        _moe_down_kernel[_grid(d_tiles, triton.cdiv(hid, dbn), dn_slices, d_first)](
            h, order, row_end, tw, dn, down_scale, y, e, hid, inter,
            h.stride(0), dn.stride(0), dn.stride(1), down_scale.stride(0),
            down_scale.stride(1), y.stride(-2), dn_tiles, y.stride(0) if dn_slices > 1 else 0,
            F32=f32, E_P2=ep2, SPLIT=dn_slices > 1, BLOCK_M=dbm, BLOCK_N=dbn, BLOCK_K=dbk,
            SWAP=bool(drest[0]) if drest else dbm < 64, SCALED=dscaled, WORDS=dn is not down,
            N_FIRST=_n_first(d_tiles, d_first), num_warps=dwarps, num_stages=dstages)
        if dn_slices > 1:
            block = min(1024, next_pow2(hid))
            if before_combine is not None:
                before_combine()
            _moe_combine_kernel[(t, triton.cdiv(hid, block))](
                y, out, hid, top_k, y.stride(1), out.stride(0), dn_slices, y.stride(0),
                ACCUMULATE=accumulate, BLOCK=block, **pdl_kwargs(out.device))
            return
    block = min(1024, next_pow2(hid))
    if before_combine is not None:
        before_combine()
    _moe_combine_kernel[(t, triton.cdiv(hid, block))](
        y, out, hid, top_k, y.stride(0), out.stride(0), 1, 0, ACCUMULATE=accumulate, BLOCK=block,
        **pdl_kwargs(out.device))



_GRID_Y_MAX = 65535  # CUDA's limit on grid axis 1


def _n_first(row_tiles: int, asked: bool) -> bool:
    """Whether the tiled GEMMs run N-tiles first (``_tile_ids``): asked for, and the row tiles
    fit grid axis 1."""
    return asked and row_tiles <= _GRID_Y_MAX


def _grid(row_tiles: int, n_tiles: int, slices: int, asked: bool) -> tuple[int, int, int]:
    """The tiled GEMMs' grid in the order :func:`_n_first` picks."""
    if _n_first(row_tiles, asked):
        return n_tiles, row_tiles, slices
    return row_tiles, n_tiles, slices
