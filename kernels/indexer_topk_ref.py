"""PyTorch reference of the lightning indexer with top-k: the specification of ``indexer_topk``.

Scores ``I[t, s] = sum_h weights[t, h] * ReLU(q[t, h, :] . k[s, :])`` with fp32 products and
sums, masked to ``s < kv_end[t]``; per row the ``topk`` best by (score descending, index
ascending); missing entries are index -1 with score -inf. It materialises ``[rows, T]`` fp32
(and ``[rows, H, T]`` per head slice), so it is for tests, the CPU engine and short contexts only.
``row_block`` bounds its peak for long contexts in benchmarks without changing the answer.
This module must never drift from that definition: the Triton kernels are checked against it.
"""

from __future__ import annotations

import torch


def indexer_scores_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    kv_end: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked scores [S, T] fp32 (-inf where s >= kv_end[t]); heads summed in index order.

    With scales (FP8): ``k_scale[s] * sum_h (weights[t, h] * q_scale[t, h]) * ReLU(q . k)``.
    """
    num_rows, num_heads, _ = q.shape
    kf = k.float()
    w = weights.float() if q_scale is None else weights.float() * q_scale.float()
    scores = torch.zeros(num_rows, k.shape[0], dtype=torch.float32, device=q.device)
    for h in range(num_heads):
        scores += w[:, h : h + 1] * torch.relu(q[:, h, :].float() @ kf.T)
    if k_scale is not None:
        scores *= k_scale.float()[None, :]
    cols = torch.arange(k.shape[0], device=q.device)
    scores.masked_fill_(cols[None, :] >= kv_end[:, None].long(), float("-inf"))
    # -0.0 and +0.0 are one value: ties between them are broken by index like any other.
    return scores + 0.0


def indexer_topk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    kv_end: torch.Tensor,
    topk: int,
    *,
    row_block: int | None = None,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference top-k of the indexer scores: (scores [S, topk] fp32, indices [S, topk] int32)."""
    num_rows = q.shape[0]
    out_scores = torch.full((num_rows, topk), float("-inf"), dtype=torch.float32, device=q.device)
    out_idx = torch.full((num_rows, topk), -1, dtype=torch.int32, device=q.device)
    step = row_block or max(num_rows, 1)
    for r0 in range(0, num_rows, step):
        r1 = min(r0 + step, num_rows)
        qs = q_scale[r0:r1] if q_scale is not None else None
        scores = indexer_scores_ref(q[r0:r1], k, weights[r0:r1], kv_end[r0:r1], qs, k_scale)
        # A stable descending sort keeps equal scores in ascending index order: the tie-break.
        vals, idx = torch.sort(scores, dim=1, descending=True, stable=True)
        n = min(topk, scores.shape[1])
        vals, idx = vals[:, :n], idx[:, :n]
        idx = torch.where(vals == float("-inf"), -1, idx)
        out_scores[r0:r1, :n] = vals
        out_idx[r0:r1, :n] = idx.to(torch.int32)
    return out_scores, out_idx


def indexer_topk_naive(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, kv_end: torch.Tensor, topk: int
) -> torch.Tensor:
    """The transformers formulation (one matmul into [S, H, T] fp32), for benchmarks only.

    Returns indices [S, min(topk, T)] int64 from ``torch.topk`` (tie order unspecified).
    """
    scores = torch.matmul(q.float(), k.float().T.unsqueeze(0))  # [S, H, T]  (q: [S, H, D])
    scores = (torch.relu(scores) * weights.float().unsqueeze(-1)).sum(dim=1)
    cols = torch.arange(k.shape[0], device=q.device)
    scores.masked_fill_(cols[None, :] >= kv_end[:, None].long(), float("-inf"))
    return scores.topk(min(topk, k.shape[0]), dim=-1).indices
