"""Triton kernels of the MXFP4 routed experts (see ``kernels.mxfp4_moe``).

A counting sort on the device (``_moe_row_end_kernel`` then ``_moe_order_kernel``) writes
``row_end [E]`` (inclusive end of each expert's run of rows) and ``order`` (sorted position ->
pair index) into the caller's workspace: no torch op, so no allocation and no host sync. Every
GEMM program finds its expert and row tile from ``row_end`` by itself (a cumulative sum of
per-expert tile counts), so one launch covers every expert with a grid sized by tokens x top-k,
and programs past the last touched expert's tile exit at once: only touched experts' weights
are read, each once per row tile.

Weights are decoded from bytes in registers: one vectorised load of packed e2m1 bytes, both
nibbles through an fp16 bitcast, interleaved back into column order, and the e8m0 scale of each
32-wide K group applied by broadcasting over a [N, K/32, 32] view. No fp4/fp8 dtype and no
Hopper-only instruction. Decode tiles (``BLOCK_M`` < 64, a few rows per expert) swap the
operands: the decoded weight tile is the dot's M side (wide, register-resident) and the few
token rows its N side, so a program streams ``BLOCK_N`` weight rows with no padding waste.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._moe_sort_triton import BLOCKED_SORT_MIN_PAIRS, launch_tiled_sort
from kernels._pdl_triton import l2_prefetch, pdl_wait
from kernels._triton_support import PDL_PREFETCH, interpreting, next_pow2, pdl_kwargs
from kernels.moe_sort_sizes import GEMV_MAX_PAIRS, PREFILL_MIN_PAIRS

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
def _mxfp4_tile(w_rows, s_rows, kb, kg, n_ok, K_BYTES, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """``BLOCK_N`` rows (``w_rows``/``s_rows`` [BN, 1] row pointers) at packed byte columns
    ``kb`` [BK/2] and scale groups ``kg`` [BK/32] -> fp32 [BN, BK] in column order."""
    ok = n_ok[:, None] & (kb < K_BYTES)[None, :]
    b = tl.load(w_rows + kb[None, :], mask=ok, other=0).to(tl.int32)
    nib = tl.interleave(b & 0xF, b >> 4)  # lower nibble is the even column
    bits = ((nib & 8) << 12) | ((nib & 7) << 9)  # sign, then exponent+mantissa into fp16
    v = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_BYTES // 16)[None, :],
                 other=127).to(tl.int32)
    f = (sc << 23).to(tl.float32, bitcast=True) * 16384.0  # 2**(s-127), and fp16's 2**14 back
    v = v.reshape(BLOCK_N, BLOCK_K // 32, 32) * f[:, :, None]
    return v.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _bf16_pair(wd, J: tl.constexpr):
    """Nibbles ``J`` and ``J + 4`` of int32 words ``wd`` -> two bf16 tensors of value * 2**-126:
    both bf16 bit patterns built at once in the halves of one int32 (e2m1's exponent and
    mantissa shifted under bf16's, whose subnormals hold 0.5, and the sign), then split."""
    t = wd >> (4 * J)
    pair = ((t & 0x00070007) << 6) | ((t & 0x00080008) << 12)
    lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _mxfp4_tile_words(w_rows, s_rows, kw, kg, n_ok, K_WORDS, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, F32: tl.constexpr):
    """``BLOCK_N`` rows (``w_rows`` [BN, 1] int32 word row pointers, ``s_rows`` scale rows) at
    word columns ``kw`` [BK/8] and scale groups ``kg`` [BK/32] -> [BN, BK] in column order
    (nibble j of word w is column 8w + j; joins put the decoded pairs in that order). bf16 with
    no float conversion: bf16 bit patterns (:func:`_bf16_pair`), times 2**126 and the group's
    e8m0 scale in bf16 (exact: powers of two; two products, as 2**(s - 1) alone overflows bf16
    from s = 129). F32 (fp32 activations, and the interpreter, whose bf16 arithmetic is not
    IEEE): fp32 from fp16 bit patterns (:func:`_nibble_pair`) scaled in fp32."""
    ok = n_ok[:, None] & (kw < K_WORDS)[None, :]
    wd = tl.load(w_rows + kw[None, :], mask=ok, other=0)
    sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_WORDS // 4)[None, :],
                 other=127).to(tl.int32)
    f = (sc << 23).to(tl.float32, bitcast=True)  # 2**(s - 127)
    if F32:
        lo0, hi0 = _nibble_pair(wd, 0)
        lo1, hi1 = _nibble_pair(wd, 1)
        lo2, hi2 = _nibble_pair(wd, 2)
        lo3, hi3 = _nibble_pair(wd, 3)
        f = f * 16384.0  # fp16's 2**14 back
    else:
        lo0, hi0 = _bf16_pair(wd, 0)
        lo1, hi1 = _bf16_pair(wd, 1)
        lo2, hi2 = _bf16_pair(wd, 2)
        lo3, hi3 = _bf16_pair(wd, 3)
        f = f.to(tl.bfloat16)
    # three joins: the first one's index (lo/hi: column bit 2) is the slowest of the three
    q0 = tl.join(tl.join(lo0, hi0), tl.join(lo2, hi2))
    q1 = tl.join(tl.join(lo1, hi1), tl.join(lo3, hi3))
    v = tl.join(q0, q1).reshape(BLOCK_N, BLOCK_K)
    if not F32:
        v = v * tl.full((1, 1), 2.0 ** 126, tl.bfloat16)
    v = v.reshape(BLOCK_N, BLOCK_K // 32, 32) * f[:, :, None]
    return v.reshape(BLOCK_N, BLOCK_K)


@triton.jit
def _dot_acc(acc, a, w, SWAP: tl.constexpr, F32: tl.constexpr):
    """acc + a @ w^T ([BM, BN]) or, SWAP, acc + w @ a ([BN, BM]; ``a`` given as [BK, BM]).
    F32: fp32 operands with an IEEE dot (fp32 activations, and the interpreter)."""
    # one return at the end: code after a constexpr-guarded early return is still compiled
    if F32:
        if SWAP:
            acc = tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        if SWAP:  # noqa: SIM108 (a static branch: each side has its own shapes)
            acc = tl.dot(w.to(a.dtype), a, acc)
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc


@triton.jit
def _mx_acc(acc, a, w_rows, s_rows, kb, kg, kw, n_ok, K_BYTES, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SWAP: tl.constexpr, F32: tl.constexpr, SCALED: tl.constexpr,
            WORDS: tl.constexpr):
    """acc + the product of activations ``a`` and the MXFP4 weight tile at byte columns ``kb``
    (layouts as :func:`_dot_acc`). SCALED: Triton's own microscaling dot (``tl.dot_scaled``,
    bf16 x e2m1 with the e8m0 scales; the compiler upcasts the weights where the GPU has no
    fp4 MMA); WORDS: ``w_rows`` point at int32 words, decoded at word columns ``kw`` straight to
    bf16 (:func:`_mxfp4_tile_words`); else the weights decoded here (:func:`_mxfp4_tile`)."""
    if SCALED:
        ok = n_ok[:, None] & (kb < K_BYTES)[None, :]
        wb = tl.load(w_rows + kb[None, :], mask=ok, other=0)  # [BN, BK/2] packed e2m1
        sc = tl.load(s_rows + kg[None, :], mask=n_ok[:, None] & (kg < K_BYTES // 16)[None, :],
                     other=127)  # [BN, BK/32] e8m0
        if SWAP:
            acc = tl.dot_scaled(wb, sc, "e2m1", a.to(tl.bfloat16), None, "bf16", acc)
        else:
            acc = tl.dot_scaled(a.to(tl.bfloat16), None, "bf16", tl.trans(wb), sc, "e2m1", acc)
    elif WORDS:
        acc = _dot_acc(acc, a, _mxfp4_tile_words(w_rows, s_rows, kw, kg, n_ok, K_BYTES // 4,
                                                 BLOCK_N, BLOCK_K, F32), SWAP, F32)
    else:
        acc = _dot_acc(acc, a, _mxfp4_tile(w_rows, s_rows, kb, kg, n_ok, K_BYTES, BLOCK_N, BLOCK_K),
                       SWAP, F32)
    return acc


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
            k = k0 + tl.arange(0, BLOCK_K)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            a_ok = r_ok[:, None] & (k < k_hi)[None, :]
            if SWAP:
                a = tl.load(x_ptr + tok[None, :] * stride_xm + k[:, None], mask=tl.trans(a_ok),
                            other=0.0)
            else:
                a = tl.load(x_ptr + tok[:, None] * stride_xm + k[None, :], mask=a_ok, other=0.0)
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
            k = k0 + tl.arange(0, BLOCK_K)
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            a_ok = r_ok[:, None] & (k < k_hi)[None, :]
            if SWAP:
                a = tl.load(h_ptr + rows[None, :] * stride_hm + k[:, None], mask=tl.trans(a_ok),
                            other=0.0)
            else:
                a = tl.load(h_ptr + rows[:, None] * stride_hm + k[None, :], mask=a_ok, other=0.0)
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


@triton.jit
def _nibble_pair(wd, J: tl.constexpr):
    """Nibbles ``J`` and ``J + 4`` of int32 words ``wd`` (packed e2m1, nibble j is column
    8w + j) -> two fp32 tensors of value * 2**-14: both fp16 bit patterns are built at once in
    the two halves of one int32 (e2m1's exponent and mantissa shifted from bits 4J.. under
    fp16's bits 9-11, its sign from 4J + 3 to 15; fp16's subnormals hold 0.5), then split:
    two shifts and two masks a pair (the masks as signed int32 constants, so nothing widens)."""
    if J < 3:  # noqa: SIM108 (a static branch: a negative shift is not a shift)
        mag = wd << (9 - 4 * J)
    else:
        mag = wd >> 3
    pair = (mag & 0x0E000E00) | ((wd << (12 - 4 * J)) & -0x7FFF8000)  # 0x80008000 as int32
    lo = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


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


# BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, swap[, scaled]]; BLOCK_M 1 is the per-pair
# GEMV form (no sort, no MMA: ``_moe_gemv_*``), for a decode step's few pairs; swap (default: BLOCK_M <
# 64) makes the decoded weight tile the dot's first operand, so it can stay in registers (wgmma
# takes its A operand from registers) instead of going through shared memory; scaled (default
# off; bf16/fp16 activations only) lets ``tl.dot_scaled`` decode the weights; words decodes
# int32 words straight to bf16; n-first orders the programs N-tiles first (``_tile_ids``)
MoeTiles = tuple[int, ...]


WIDE_ROWS_PER_EXPERT = 160  # mean rows an expert from which the 256-row prefill tiles pay
# prefill tiles: swapped, not dot_scaled, int32 words straight to bf16, N-tiles first; the wide
# ones hold 256 rows (a decoded weight tile feeds twice the rows), their down GEMM its own
PREFILL_TILES: MoeTiles = (128, 128, 128, 8, 3, 1, 0, 1, 1)
WIDE_PREFILL_TILES: MoeTiles = (256, 64, 128, 8, 3, 1, 0, 1, 1)
WIDE_DOWN_TILES: MoeTiles = (128, 128, 128, 8, 3, 0, 0, 1, 1)


def moe_tiles(num_pairs: int, hidden: int = 4096, num_experts: int = 0) -> MoeTiles:
    """Tiles of the gate-up GEMM, and of the down GEMM where :func:`moe_down_tiles` gives it
    no tiles of its own. Up to ``GEMV_MAX_PAIRS`` pairs (8 tokens at top-6) the per-pair
    GEMV form: on the H200 (lab/results/quant_decode_sweep_moe_h200.json) 0.074 against 0.091 ms at
    one token and 0.446 against 0.502 at 8, 1.69 against 1.06 ms at 32 (the tiled form reads
    an expert once for all its rows). Decode beyond (a few rows per expert): 16-row tiles with
    swapped operands; prefill: 128 x 128 x 128 tiles, swapped too, so a decoded weight tile feeds 128
    rows from registers. H200 sweep at 4096 tokens x top-6, 128 experts (lab/results/notebook.md,
    2026-12-04): 7.09 ms swapped against 8.26 ms for the earlier 128 x 128 x 64 unswapped tiles;
    40 KiB of shared memory, so the same tiles fit an SM120's 99 KiB. Since the twelfth session
    (lab/results/notebook.md, H100): the per-pair form at 2 warps with int32-word weights (0.061 ms
    at one token with the gate-up split of ``moe_splits``), and the prefill tiles decode words
    straight to bf16 (6.37 against 6.57 ms at 4096 tokens, 11.03 against 11.58 at 8192).
    Thirteenth session (H100, both GEMMs, 128 experts): the programs N-tiles first (10.23
    against 11.02 ms at 8192 tokens) and, from ``WIDE_ROWS_PER_EXPERT`` mean rows an expert,
    256 x 64 tiles (9.77 at 8192, 5.17 against 5.97 at 4096; at 2048 tokens, 96 rows an
    expert, they lose: 5.01 against 3.21). 80 KiB of shared memory on sm_120."""
    if num_pairs <= GEMV_MAX_PAIRS:  # the 6th element: int32-word decode (``_gemv_acc``)
        return (1, 32, 64, 4, 1, 1) if interpreting() else (1, 16, 256, 2, 3, 1)
    if interpreting():
        return (16, 32, 64, 4, 1) if num_pairs <= PREFILL_MIN_PAIRS else (64, 32, 64, 4, 1)
    if num_pairs <= PREFILL_MIN_PAIRS:
        return 16, 64, 128, 4, 3
    if num_experts and num_pairs >= WIDE_ROWS_PER_EXPERT * num_experts:
        return WIDE_PREFILL_TILES
    return PREFILL_TILES


def moe_down_tiles(gate_up_tiles: MoeTiles) -> MoeTiles:
    """The down GEMM's tiles beside the gate-up GEMM's default ones: its K (the intermediate
    width, 2048 at V4-Flash) is half the gate-up's, and with the 256-row tiles it was faster at
    128 x 128 x 128 unswapped, N-tiles first (H100, 2026-12-06: 9.45 against 9.74 ms for both
    GEMMs at 8192 tokens, 5.18 against 5.23 at 4096); else the gate-up's own."""
    return WIDE_DOWN_TILES if gate_up_tiles == WIDE_PREFILL_TILES else gate_up_tiles


def split_k_slices(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(slices, K-tiles a slice) when ``k`` is cut into at most ``split`` slices of whole
    ``block_k`` tiles, none empty (one slice: the whole K)."""
    tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(tiles, max(split, 1))
    return triton.cdiv(tiles, per), per


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


def _as_words(w: torch.Tensor) -> torch.Tensor | None:
    """Packed MXFP4 bytes [E, N, K/2] as int32 words [E, N, K/8] (the same memory), or None
    where the layout does not allow it (rows not whole words, or not word-aligned)."""
    if (w.dtype != torch.uint8 or w.stride(-1) != 1 or w.shape[-1] % 4
            or w.storage_offset() % 4 or any(st % 4 for st in w.stride()[:-1])):
        return None
    return w.view(torch.int32)


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
