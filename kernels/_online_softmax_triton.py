"""Online-softmax pieces shared by the attention kernels (``_paged_attention_triton``,
``_sparse_attention_triton``): the running (max, sum, acc) state, folding a tile of scores into
it, a split's partial state written out, and flash-decoding's second pass that merges them. Scores are in the log2
domain (``exp2``). Device functions only: nothing here launches or allocates.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_start(BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The empty state of ``BLOCK_R`` rows: (max -inf [R], sum 0 [R], acc 0 [R, D]), fp32."""
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def softmax_fold(s, v, m_i, l_i, acc):
    """Fold scores ``s`` [BM, BN] (masked entries -inf) and values ``v`` [BN, BD] into the
    running max ``m_i`` [BM], sum ``l_i`` [BM] and ``acc`` [BM, BD] -> (m, l, acc). A row with
    every score masked so far keeps max -inf and adds nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def store_partials(part_acc_ptr, part_ml_ptr, part, acc, m_i, l_i, mask, BLOCK_D: tl.constexpr):
    """One split's unnormalised state at partial rows ``part`` [R] (``mask``): ``acc`` [R, D]
    as rows of ``BLOCK_D`` fp32, (max, sum) pairs; :func:`merge_splits` reads them back."""
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc,
             mask=mask[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=mask)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=mask)


@triton.jit
def merge_splits(part_acc_ptr, part_ml_ptr, first, num_splits, sink, HAS_SINK: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The normalised output [BLOCK_D] of the ``num_splits`` partials from row ``first``:
    ``part_acc`` rows of ``BLOCK_D`` fp32, ``part_ml`` (max, sum) pairs. ``HAS_SINK``: the
    attention sink ``sink`` (log2 domain) joins the denominator only."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    part = first + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINK:
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    l_tot = tl.sum(l_part * w, 0)
    if HAS_SINK:
        l_tot += tl.exp2(sink - m_max)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    return tl.sum(acc * w[:, None], 0) / tl.where(l_tot == 0.0, 1.0, l_tot)
