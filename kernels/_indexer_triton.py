"""Triton kernels of ``kernels.indexer_topk`` (imported lazily: needs triton).

Per KV tile of TILE_W keys, two launches:
1. ``_indexer_scores_kernel`` writes the tile's masked scores [S, TILE_W] fp32 into scratch,
   the head reduction fused (``sum_h w * ReLU(q_h . k)`` in registers, never [S, H, W]).
2. ``_topk_merge_kernel`` folds the tile into each row's running best-KP list. Every score
   becomes one int64 key (order-preserving score bits << 32 | ~index), so keys are distinct
   and "higher score, then lower index" is plain integer order. Keys above the row's current
   k-th best are compacted into a small candidate buffer; each full buffer of KP candidates is
   merged with a bitonic step (max of best-descending and candidates-ascending, then sort).
A final launch unpacks the best list into (scores, indices). Scratch is
S*TILE_W*4 + S*KP*8*3 bytes whatever the context length. Nothing here allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._pdl_triton import pdl_wait
from kernels._triton_support import interpreting, pdl_kwargs

_INT64_MIN = tl.constexpr(-9223372036854775808)


@triton.jit
def _pack(score, idx):
    """int64 key ordered like (score ascending, index descending); distinct for distinct idx."""
    bits = score.to(tl.int32, bitcast=True)
    key32 = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = (-1 - idx.to(tl.int32)).to(tl.uint32, bitcast=True).to(tl.int64)  # idx may be int64
    return (key32.to(tl.int64) << 32) | low


@triton.jit
def _unpack(key):
    key32 = (key >> 32).to(tl.int32)
    bits = tl.where(key32 >= 0, key32, key32 ^ 0x7FFFFFFF)
    score = bits.to(tl.float32, bitcast=True)
    idx = -1 - key.to(tl.int32)
    return score, idx


@triton.jit
def _compare_swap(x, S: tl.constexpr, J: tl.constexpr, L: tl.constexpr, DESC: tl.constexpr):
    """One bitonic step on x [2**L]: order pairs differing in index bit J, blocks of 2**S."""
    y = tl.permute(tl.reshape(x, [2 ** (L - 1 - J), 2, 2**J]), (0, 2, 1))
    a, b = tl.split(y)
    lo = tl.minimum(a, b)
    hi = tl.maximum(a, b)
    o = tl.arange(0, 2 ** (L - 1 - J))[:, None]
    if S < L:  # noqa: SIM108 (a constexpr branch; keep it a plain statement for Triton)
        flip = ((o >> (S - J - 1)) & 1) == 1
    else:
        flip = o < 0
    if DESC:
        flip = flip == 0
    y = tl.permute(tl.join(tl.where(flip, hi, lo), tl.where(flip, lo, hi)), (0, 2, 1))
    return tl.reshape(y, [2**L])


@triton.jit
def _bitonic_sort(x, L: tl.constexpr, DESC: tl.constexpr):
    for S in tl.static_range(1, L + 1):
        for jj in tl.static_range(S):
            x = _compare_swap(x, S, S - 1 - jj, L, DESC)
    return x


@triton.jit
def _merge_desc(best, cand, L: tl.constexpr):
    """Top-2**L of best (sorted descending) and cand (any order), sorted descending."""
    cand = _bitonic_sort(cand, L, False)
    x = tl.maximum(best, cand)  # bitonic, and holds exactly the top 2**L of the union
    for jj in tl.static_range(L):
        x = _compare_swap(x, L, L - 1 - jj, L, True)
    return x


@triton.jit
def _merge_sorted_desc(a, b, L: tl.constexpr):
    """Top-2**L of two lists each sorted descending, sorted descending: ``a`` against ``b``
    reversed is already bitonic, so no sort of ``b`` first (L stages, not L(L+3)/2)."""
    x = tl.maximum(a, tl.flip(b, 0))
    for jj in tl.static_range(L):
        x = _compare_swap(x, L, L - 1 - jj, L, True)
    return x


@triton.jit
def _kth(best, offs, k):
    return tl.sum(tl.where(offs == k - 1, best, 0), axis=0)


# Ints that change from step to step are not specialised (==1, %16): a prompt length or
# batch size the warm-up did not see must not compile a new variant while serving.
@triton.jit(do_not_specialize=["num_rows", "col0", "n_cols"])
def _indexer_scores_kernel(
    q_ptr, k_ptr, w_ptr, kv_end_ptr, scores_ptr, q_scale_ptr, k_scale_ptr,
    num_rows, num_heads, head_dim, col0, n_cols,
    stride_qs, stride_qh, stride_k, stride_ws, stride_wh, stride_ss, stride_qss, stride_qsh,
    HAS_Q_SCALE: tl.constexpr, HAS_K_SCALE: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_local = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col0 + cols_local
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    col_mask = cols_local < n_cols
    d_mask = offs_d < head_dim
    kv_end = tl.load(kv_end_ptr + rows, mask=row_mask, other=0)
    # Blocks wholly past every row's visible end are never read by the merge: run no heads.
    # (A loop bound, not an `if` around the loop, so the software pipeliner still applies.)
    any_visible = tl.max(kv_end, axis=0) > col0 + tl.program_id(1) * BLOCK_N
    heads_to_run = tl.where(any_visible, num_heads, 0)
    k = tl.load(k_ptr + cols.to(tl.int64)[:, None] * stride_k + offs_d[None, :],
                mask=col_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    k_t = tl.trans(k)
    q_base = q_ptr + rows.to(tl.int64)[:, None] * stride_qs + offs_d[None, :]
    qd_mask = row_mask[:, None] & d_mask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for h in range(0, heads_to_run):
        q_h = tl.load(q_base + h * stride_qh, mask=qd_mask, other=0.0)
        if UPCAST:
            q_h = q_h.to(tl.float32)
        w_h = tl.load(w_ptr + rows * stride_ws + h * stride_wh, mask=row_mask, other=0.0)
        w_h = w_h.to(tl.float32)
        if HAS_Q_SCALE:  # a positive scale commutes with ReLU: fold it into the weight
            w_h *= tl.load(q_scale_ptr + rows * stride_qss + h * stride_qsh, mask=row_mask,
                           other=0.0)
        s = tl.dot(q_h, k_t)
        acc += w_h[:, None] * tl.maximum(s, 0.0)
    if HAS_K_SCALE:
        acc *= tl.load(k_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    acc = tl.where(cols[None, :] < kv_end[:, None], acc, float("-inf"))
    acc = tl.where(acc == 0.0, 0.0, acc)  # -0.0 -> +0.0: one value, ties broken by index
    tl.store(scores_ptr + rows.to(tl.int64)[:, None] * stride_ss + cols_local[None, :], acc,
             mask=row_mask[:, None] & col_mask[None, :])


# Ints that change from step to step are not specialised (==1, %16): a prompt length or
# batch size the warm-up did not see must not compile a new variant while serving.
@triton.jit(do_not_specialize=["col0", "n_cols"])
def _topk_merge_kernel(
    scores_ptr, kv_end_ptr, best_ptr, cand_ptr,
    col0, n_cols, topk, stride_ss,
    KP: tl.constexpr, LOG_KP: tl.constexpr, PARTS: tl.constexpr = 1, PDL: tl.constexpr = 0,
):
    """One program per (row, part): part p of ``PARTS`` merges the p-th slice of the tile's
    columns (whole multiples of KP wide) into its own running best (``best_ptr`` / ``cand_ptr``
    rows ``row * PARTS + p``); ``_topk_combine_kernel`` merges the parts' bests at the end."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // PARTS
    width = tl.cdiv(tl.cdiv(n_cols, PARTS), KP) * KP  # a part's columns
    lo = (pid % PARTS) * width
    offs = tl.arange(0, KP)
    best_row = best_ptr + pid * KP
    cand_row = cand_ptr + pid * (2 * KP)
    best = tl.load(best_row + offs)
    thr = _kth(best, offs, topk)
    n_visible = tl.minimum(tl.minimum(tl.load(kv_end_ptr + row) - col0, n_cols) - lo, width)
    n_pend = 0
    for c0 in range(0, n_visible, KP):
        cols = c0 + offs
        s = tl.load(scores_ptr + row * stride_ss + lo + cols, mask=cols < n_visible,
                    other=float("-inf"))
        key = _pack(s, col0 + lo + cols)
        passing = (key > thr) & (s > float("-inf"))
        n_pass = tl.sum(passing.to(tl.int32), axis=0)
        if n_pass > 0:
            pos = n_pend + tl.cumsum(passing.to(tl.int32), axis=0) - 1
            tl.store(cand_row + pos, key, mask=passing)
            n_pend += n_pass
            if n_pend >= KP:
                tl.debug_barrier()
                best = _merge_desc(best, tl.load(cand_row + offs), LOG_KP)
                thr = _kth(best, offs, topk)
                rest_mask = offs < n_pend - KP
                rest = tl.load(cand_row + KP + offs, mask=rest_mask, other=_INT64_MIN)
                tl.debug_barrier()
                tl.store(cand_row + offs, rest, mask=rest_mask)
                tl.debug_barrier()
                n_pend -= KP
    if n_pend > 0:
        tl.debug_barrier()
        cand = tl.load(cand_row + offs, mask=offs < n_pend, other=_INT64_MIN)
        best = _merge_desc(best, cand, LOG_KP)
    tl.store(best_row + offs, best)


@triton.jit
def _topk_combine_kernel(best_ptr, out_ptr, KP: tl.constexpr, LOG_KP: tl.constexpr,
                         PARTS: tl.constexpr, PDL: tl.constexpr = 0):
    """A row's ``PARTS`` running bests (each the top KP of its columns, descending) -> the top
    KP of their union, descending, at ``out_ptr`` row ``row``."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KP)
    best = tl.load(best_ptr + row * PARTS * KP + offs)
    for p in tl.static_range(1, PARTS):
        best = _merge_sorted_desc(best, tl.load(best_ptr + (row * PARTS + p) * KP + offs),
                                  LOG_KP)
    tl.store(out_ptr + row * KP + offs, best)


@triton.jit
def _topk_init_kernel(best_ptr, KP: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    offs = tl.arange(0, KP)
    tl.store(best_ptr + tl.program_id(0).to(tl.int64) * KP + offs,
             tl.full([KP], _INT64_MIN, tl.int64))


@triton.jit
def _topk_finalize_kernel(
    best_ptr, out_scores_ptr, out_idx_ptr, topk, stride_os, stride_oi, KP: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KP)
    score, idx = _unpack(tl.load(best_ptr + row * KP + offs))
    valid = score > float("-inf")
    keep = offs < topk
    tl.store(out_scores_ptr + row * stride_os + offs, tl.where(valid, score, float("-inf")),
             mask=keep)
    tl.store(out_idx_ptr + row * stride_oi + offs, tl.where(valid, idx, -1), mask=keep)


@dataclass(frozen=True)
class IndexerOperands:
    """What the scores are computed from (shapes as ``kernels.indexer_topk``, already checked):
    q [R, H, D], k [N, D], weights [R, H], kv_end [R], and the FP8 scales of q and k (None for
    bf16 operands)."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    kv_end: torch.Tensor
    q_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None


def launch_indexer_scores(
    ops: IndexerOperands,
    *,
    scores: torch.Tensor,
    col0: int,
    n_cols: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Masked scores of keys [col0, col0 + n_cols) into scores[:, :n_cols] (one tile)."""
    q, k, weights, kv_end, q_scale, k_scale = (ops.q, ops.k, ops.weights, ops.kv_end,
                                               ops.q_scale, ops.k_scale)
    num_rows, num_heads, head_dim = q.shape
    block_d = max(16, 1 << max(head_dim - 1, 0).bit_length())
    qs_strides = q_scale.stride() if q_scale is not None else (0, 0)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n_cols, block_n))
    _indexer_scores_kernel[grid](
        q, k, weights, kv_end, scores,
        q_scale if q_scale is not None else weights, k_scale if k_scale is not None else kv_end,
        num_rows, num_heads, head_dim, col0, n_cols,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), weights.stride(1),
        scores.stride(0), qs_strides[0], qs_strides[1],
        HAS_Q_SCALE=q_scale is not None, HAS_K_SCALE=k_scale is not None,
        UPCAST=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages,
    )


def launch_indexer_topk(
    ops: IndexerOperands,
    *,
    topk: int,
    kp: int,
    scores: torch.Tensor,
    best: torch.Tensor,
    cand: torch.Tensor,
    out_scores: torch.Tensor,
    out_indices: torch.Tensor,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Run the tile loop; every buffer was checked and carved by ``kernels.indexer_topk``."""
    num_rows = ops.q.shape[0]
    num_keys = ops.k.shape[0]
    tile_w = scores.shape[1]
    pdl = pdl_kwargs(ops.q.device)
    _topk_init_kernel[(num_rows,)](best, KP=kp, **pdl)
    for col0 in range(0, num_keys, tile_w):
        n_cols = min(tile_w, num_keys - col0)
        launch_indexer_scores(
            ops, scores=scores, col0=col0, n_cols=n_cols, block_m=block_m, block_n=block_n,
            num_warps=num_warps, num_stages=num_stages,
        )
        _topk_merge_kernel[(num_rows,)](
            scores, ops.kv_end, best, cand, col0, n_cols, topk, scores.stride(0),
            KP=kp, LOG_KP=kp.bit_length() - 1, num_warps=4, **pdl,
        )
    _topk_finalize_kernel[(num_rows,)](
        best, out_scores, out_indices, topk, out_scores.stride(0), out_indices.stride(0), KP=kp
    )
