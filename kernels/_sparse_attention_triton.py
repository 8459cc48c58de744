"""Triton kernels of ``kernels.sparse_attention`` (imported lazily: needs triton).

One program per (query row, block of heads, split). The row's entries (window, indexed
compressed entries, compressed range) are streamed in tiles of BLOCK_N rows of the shared KV
head; each tile is used as key and value (K == V). Online softmax in fp32 registers. With one
split nothing else is needed; with several (few rows, e.g. decode) each split owns a slice of
each entry list and writes a partial (acc, max, sum) into the caller's workspace, and a second
launch merges them (flash-decoding). This module must never allocate: the wrapper hands it
every buffer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._online_softmax_triton import merge_splits, softmax_fold, softmax_start, store_partials
from kernels._pdl_triton import pdl_wait
from kernels._triton_support import interpreting, pdl_kwargs

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _online_tile(q, kv, valid, qk_scale, m_i, l_i, acc, UPCAST: tl.constexpr):
    """Fold one tile of KV rows [BLOCK_N, BLOCK_D] (K == V) into the online-softmax state."""
    if UPCAST:
        kv = kv.to(tl.float32)
    s = tl.dot(q, tl.trans(kv)) * qk_scale  # [BLOCK_H, BLOCK_N], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    return softmax_fold(s, kv, m_i, l_i, acc)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, out_ptr, wkv_ptr, wstart_ptr, wend_ptr, bt_ptr, rowseq_ptr,
    ckv_ptr, idx_ptr, cstart_ptr, cend_ptr, sink_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, num_heads, head_dim, num_idx, num_splits,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_wblock, stride_wrow, stride_bt, stride_c, stride_idx,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, HAS_IDX: tl.constexpr, HAS_RANGE: tl.constexpr,
    HAS_SINK: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0,
):
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < num_heads
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + row * stride_qs + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i, l_i, acc = softmax_start(BLOCK_H, BLOCK_D)

    w_start = tl.load(wstart_ptr + row)
    w_end = tl.load(wend_ptr + row)
    if SPLIT:  # compile-time, so the single-split kernel is exactly the one measured
        w_start, w_end = _split_range(w_start, w_end, split, num_splits, BLOCK_N)
    if PAGED:
        seq = tl.load(rowseq_ptr + row).to(tl.int64)
    for n0 in range(w_start, w_end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < w_end
        if PAGED:
            blk = tl.load(bt_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=valid, other=0)
            off = blk.to(tl.int64) * stride_wblock + (pos % PAGE_SIZE).to(tl.int64) * stride_wrow
        else:
            off = pos.to(tl.int64) * stride_wrow
        kv = tl.load(wkv_ptr + off[:, None] + offs_d[None, :],
                     mask=valid[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_tile(q, kv, valid, qk_scale, m_i, l_i, acc, UPCAST)

    if HAS_IDX:
        j_start = 0
        j_end = num_idx
        if SPLIT:
            j_start, j_end = _split_range(j_start, j_end, split, num_splits, BLOCK_N)
        for j0 in range(j_start, j_end, BLOCK_N):
            j = j0 + offs_n
            idx = tl.load(idx_ptr + row * stride_idx + j, mask=j < j_end, other=-1)
            valid = idx >= 0
            kv = tl.load(ckv_ptr + idx.to(tl.int64)[:, None] * stride_c + offs_d[None, :],
                         mask=valid[:, None] & d_mask[None, :], other=0.0)
            m_i, l_i, acc = _online_tile(q, kv, valid, qk_scale, m_i, l_i, acc, UPCAST)

    if HAS_RANGE:
        c_start = tl.load(cstart_ptr + row)
        c_end = tl.load(cend_ptr + row)
        if SPLIT:
            c_start, c_end = _split_range(c_start, c_end, split, num_splits, BLOCK_N)
        for n0 in range(c_start, c_end, BLOCK_N):
            pos = n0 + offs_n
            valid = pos < c_end
            kv = tl.load(ckv_ptr + pos.to(tl.int64)[:, None] * stride_c + offs_d[None, :],
                         mask=valid[:, None] & d_mask[None, :], other=0.0)
            m_i, l_i, acc = _online_tile(q, kv, valid, qk_scale, m_i, l_i, acc, UPCAST)

    if SPLIT:
        # partials: acc [S, H, splits, BLOCK_D] fp32 and (max, sum) [S, H, splits, 2] fp32
        store_partials(part_acc_ptr, part_ml_ptr, (row * num_heads + offs_h) * num_splits + split,
                       acc, m_i, l_i, h_mask, BLOCK_D)
    else:
        o = _finish(acc, m_i, l_i, sink_ptr, offs_h, h_mask, HAS_SINK)
        tl.store(out_ptr + row * stride_os + offs_h[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _split_range(start, end, split, num_splits, BLOCK_N: tl.constexpr):
    """The part of [start, end) that split ``split`` of ``num_splits`` owns (whole tiles)."""
    per = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per
    return lo, tl.minimum(end, lo + per)


@triton.jit
def _finish(acc, m_i, l_i, sink_ptr, offs_h, h_mask, HAS_SINK: tl.constexpr):
    """Normalise the online-softmax state; the sink joins the denominator only."""
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=float("-inf")).to(tl.float32)
        sink = sink * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None]


@triton.jit
def _sparse_combine_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, sink_ptr, num_heads, head_dim, num_splits,
    stride_os, stride_oh,
    HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = 0,
):
    """Merge the splits of one (row, head) into ``out`` (flash-decoding's second pass)."""
    pdl_wait(PDL)  # before any memory access (kernels/NOTES.md)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    sink = 0.0
    if HAS_SINK:
        sink = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
    o = merge_splits(part_acc_ptr, part_ml_ptr, (row * num_heads + head) * num_splits,
                     num_splits, sink, HAS_SINK, BLOCK_S, BLOCK_D)
    tl.store(out_ptr + row * stride_os + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def launch_sparse_attention(
    *,
    q: torch.Tensor,
    out: torch.Tensor,
    window_kv: torch.Tensor,
    window_start: torch.Tensor,
    window_end: torch.Tensor,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    compressed_kv: torch.Tensor,
    indices: torch.Tensor,
    compressed_start: torch.Tensor,
    compressed_end: torch.Tensor,
    sinks: torch.Tensor,
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    num_splits: int,
    scale: float,
    paged: bool,
    has_idx: bool,
    has_range: bool,
    has_sink: bool,
    block_d: int,
    max_block_h: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> None:
    """Launch the kernel; every tensor was checked by ``kernels.sparse_attention``."""
    num_rows, num_heads, head_dim = q.shape
    block_h = min(max_block_h, max(16, 1 << max(num_heads - 1, 0).bit_length()))
    if paged:
        stride_wblock, stride_wrow, page_size = window_kv.stride(0), window_kv.stride(1), window_kv.shape[1]
    else:
        stride_wblock, stride_wrow, page_size = 0, window_kv.stride(0), 1
    grid = (num_rows, triton.cdiv(num_heads, block_h), num_splits)
    pdl = pdl_kwargs(q.device)
    _sparse_attention_kernel[grid](
        q, out, window_kv, window_start, window_end, block_tables, row_seq,
        compressed_kv, indices, compressed_start, compressed_end, sinks, part_acc, part_ml,
        scale * LOG2E, num_heads, head_dim, indices.shape[1], num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        stride_wblock, stride_wrow, block_tables.stride(0), compressed_kv.stride(0),
        indices.stride(0),
        PAGE_SIZE=page_size, PAGED=paged, HAS_IDX=has_idx, HAS_RANGE=has_range, HAS_SINK=has_sink,
        UPCAST=interpreting(), SPLIT=num_splits > 1,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if num_splits > 1:
        _sparse_combine_kernel[(num_rows, num_heads)](
            part_acc, part_ml, out, sinks, num_heads, head_dim, num_splits,
            out.stride(0), out.stride(1),
            HAS_SINK=has_sink, BLOCK_S=max(2, 1 << max(num_splits - 1, 0).bit_length()),
            BLOCK_D=block_d, **pdl,
        )
