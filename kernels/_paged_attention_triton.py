"""Triton kernels of ``kernels.paged_attention`` and ``kernels.paged_decode_attention``.

Prefill/mixed: one program per (BLOCK_M query tokens of one sequence, query head); programs
find their sequence by binary search over ``query_start_loc`` (the vLLM trick: sequence b's
first tile has number query_start_loc[b] // BLOCK_M + b), so the grid is N // BLOCK_M + B and
needs no host-side metadata. Decode: one program per (sequence, KV head, split) holding the
whole GQA group as rows of the tile, flash-decoding style: each split writes a partial
(acc, max, sum) into the workspace and a second launch combines them. An FP8 e4m3fn cache
(kernels/kv_quant.py) is read through its own pointer type and cast to q's dtype after the
load. Nothing allocates here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._online_softmax_triton import merge_splits, softmax_fold, softmax_start, store_partials
from kernels._triton_support import interpreting

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _prefill_tile(
    q, m_i, l_i, acc, n0, kv_stop, q_pos, offs_n, d_mask, bt_row, k_base, v_base,
    qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
    PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold KV positions [n0, n0 + BLOCK_N) into the online-softmax state of a query block."""
    pos = n0 + offs_n
    if MASKED:
        n_mask = pos < kv_stop
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        blk = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    tok = (pos % PAGE_SIZE).to(tl.int64)
    k = tl.load(k_base + blk[:, None] * stride_kb + tok[:, None] * stride_kt, mask=kv_mask,
                other=0.0)
    v = tl.load(v_base + blk[:, None] * stride_vb + tok[:, None] * stride_vt, mask=kv_mask,
                other=0.0)
    # q's dtype (fp32 when UPCAST): the cast is also the dequantization of an FP8 cache
    # (kernels/kv_quant.py: scale 1), a no-op for a cache in the model dtype.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    return softmax_fold(s, v, m_i, l_i, acc)


# Ints that change from step to step are not specialised (==1, %16): a prompt length or
# batch size the warm-up did not see must not compile a new variant while serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qsl_ptr, ctx_ptr,
    qk_scale, num_seqs, num_q_heads, group, head_dim,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    # Largest b with query_start_loc[b] // BLOCK_M + b <= pid.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_M + mid
        if start <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = (pid - (q_start // BLOCK_M + seq)) * BLOCK_M
    if local < q_len:
        ctx = tl.load(ctx_ptr + seq)
        offs_m = local + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        m_mask = offs_m < q_len
        d_mask = offs_d < head_dim
        q_pos = ctx - q_len + offs_m
        kv_head = head // group
        q = tl.load(q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qn
                    + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
        kv_stop = tl.minimum(ctx, ctx - q_len + local + BLOCK_M)
        # Keys below the block's first query position are visible to every row of the block:
        # those tiles need no causal mask. Only the tiles on the diagonal are masked.
        full_stop = ((ctx - q_len + local + 1) // BLOCK_N) * BLOCK_N
        bt_row = bt_ptr + seq * stride_bt
        k_base = k_ptr + kv_head * stride_kh + offs_d[None, :]
        v_base = v_ptr + kv_head * stride_vh + offs_d[None, :]
        for n0 in range(0, full_stop, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, n0, kv_stop, q_pos, offs_n, d_mask, bt_row, k_base, v_base,
                qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
                PAGE_SIZE, False, UPCAST)
        for n0 in range(full_stop, kv_stop, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                q, m_i, l_i, acc, n0, kv_stop, q_pos, offs_n, d_mask, bt_row, k_base, v_base,
                qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
                PAGE_SIZE, True, UPCAST)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_on
                 + head * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# Ints that change from step to step are not specialised (==1, %16): a prompt length or
# batch size the warm-up did not see must not compile a new variant while serving.
@triton.jit(do_not_specialize=["tokens_per_split", "stride_bt", "num_splits"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, bt_ptr, ctx_ptr,
    qk_scale, group, head_dim, tokens_per_split,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    num_q_heads, num_splits,
    PAGE_SIZE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g
    ctx = tl.load(ctx_ptr + seq)
    kv_lo = split * tokens_per_split
    kv_hi = tl.minimum(ctx, kv_lo + tokens_per_split)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i, l_i, acc = softmax_start(BLOCK_G, BLOCK_D)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_hi
        blk = tl.load(bt_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=n_mask, other=0)
        blk = blk.to(tl.int64)
        tok = (pos % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + tok[:, None] * stride_kt
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # dequantizes an FP8 cache, as in _prefill_tile
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = softmax_fold(s, v, m_i, l_i, acc)
    if SPLIT:
        # partials: acc [B, Hq, splits, D] fp32, (m, l) [B, Hq, splits, 2] fp32
        store_partials(part_acc_ptr, part_ml_ptr, (seq * num_q_heads + heads) * num_splits + split,
                       acc, m_i, l_i, g_mask, BLOCK_D)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _paged_decode_combine_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, head_dim, num_q_heads, num_splits,
    stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    o = merge_splits(part_acc_ptr, part_ml_ptr, (seq * num_q_heads + head) * num_splits,
                     num_splits, 0.0, False, BLOCK_S, BLOCK_D)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def _kv_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


def launch_paged_attention(
    *, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, out: torch.Tensor,
    block_m: int, block_n: int, num_warps: int, num_stages: int,
) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = context_lens.shape[0]
    group = num_q_heads // k_cache.shape[2]
    block_d = max(16, 1 << max(head_dim - 1, 0).bit_length())
    grid = (num_tokens // block_m + num_seqs, num_q_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens,
        scale * LOG2E, num_seqs, num_q_heads, group, head_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_kv_strides(k_cache), *_kv_strides(v_cache), block_tables.stride(0),
        PAGE_SIZE=k_cache.shape[1], UPCAST=interpreting(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages,
    )


def launch_paged_decode(
    *, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, out: torch.Tensor, part_acc: torch.Tensor,
    part_ml: torch.Tensor, num_splits: int, tokens_per_split: int, block_n: int, num_warps: int,
    num_stages: int,
) -> None:
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = max(16, 1 << max(head_dim - 1, 0).bit_length())
    block_g = max(16, 1 << max(group - 1, 0).bit_length())
    split = num_splits > 1
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, context_lens,
        scale * LOG2E, group, head_dim, tokens_per_split,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_kv_strides(k_cache), *_kv_strides(v_cache), block_tables.stride(0),
        num_q_heads, num_splits,
        PAGE_SIZE=k_cache.shape[1], UPCAST=interpreting(), SPLIT=split, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _paged_decode_combine_kernel[(num_seqs, num_q_heads)](
            part_acc, part_ml, out, head_dim, num_q_heads, num_splits,
            out.stride(0), out.stride(1),
            BLOCK_S=max(2, 1 << max(num_splits - 1, 0).bit_length()), BLOCK_D=block_d,
        )
