"""The lightning indexer of CSA layers: its own overlapping compressor at ``index_head_dim``
(the index keys), its query projection, and the top-k selection over the compressed entries.

The selection is a tiled scan with a running top-k, so its scratch is bounded by
(query tile x KV tile), never by the context length. It must never materialise a
``[queries, heads, entries]`` or ``[queries, entries]`` score tensor over the whole context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.layers.compressor import V4Compressor
from engine.models.deepseek_v4.layers.rope import apply_rope_
from kernels.rope_norm import rope_norm

INDEXER_KV_TILE = 2048  # compressed entries scored per tile
INDEXER_Q_TILE = 512  # query rows per tile (scratch ~ rows x heads x tile fp32)


class _Scorer(nn.Module):
    """Holds ``weights_proj`` under transformers' name ``indexer.scorer.weights_proj``."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class V4Indexer(V4Compressor):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.csa_rate, True, cfg.rms_norm_eps)
        self.n_heads = cfg.index_n_heads
        self.topk = cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = _Scorer(cfg.hidden_size, cfg.index_n_heads)

    def queries(
        self, q_residual: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        kernels: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, Hi, Di] (rotated with the compress rope), weights: [N, Hi] fp32 with both
        softmax scales folded in (relu(a) * s == relu(a * s) for s > 0). ``kernels``: the
        rotation as one launch (kernels.rope_norm) instead of PyTorch's fp32 temporaries."""
        return self.index_queries(q_residual, cos, sin, kernels), self.score_weights(x)

    def index_queries(self, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kernels: bool = False) -> torch.Tensor:
        """q: [N, Hi, Di], rotated with the compress rope (a fresh projection: in place;
        ``kernels``: one launch)."""
        n = q_residual.shape[0]
        q = self.q_b_proj(q_residual).view(n, self.n_heads, self.dim)
        if kernels:
            return rope_norm(q, cos, sin, q, norm=False)
        return apply_rope_(q, cos, sin)

    def score_weights(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head score weights [N, Hi] fp32 of tokens x [N, hidden], scales folded in."""
        return self.scale_scores(self.scorer.weights_proj(x))

    def scale_scores(self, raw: torch.Tensor) -> torch.Tensor:
        """weights_proj's output [N, Hi] -> the score weights (fp32, both scales folded in)."""
        return raw.float() * (self.n_heads**-0.5 * self.dim**-0.5)


def indexer_topk_torch(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, kv_end: torch.Tensor, topk: int,
    *, q_tile: int = INDEXER_Q_TILE, kv_tile: int = INDEXER_KV_TILE,
) -> torch.Tensor:
    """Private stand-in for ``kernels.indexer_topk`` until it lands.

    q: [S, H, D], k: [T, D] (T >= max(kv_end)), weights: [S, H] fp32, kv_end: [S] int (query s
    sees entries ``< kv_end[s]``). Score ``I[s, t] = sum_h w[s,h] * relu(q[s,h] . k[t])`` in fp32.
    Returns indices [S, topk] int64, best first, ``-1`` where fewer than ``topk`` are visible.
    """
    s_len = q.shape[0]
    out = torch.full((s_len, topk), -1, dtype=torch.long, device=q.device)
    end = int(kv_end.max()) if s_len else 0
    if end == 0:
        return out
    for r0 in range(0, s_len, q_tile):
        r1 = min(r0 + q_tile, s_len)
        qf = q[r0:r1].float()
        w = weights[r0:r1]
        ends = kv_end[r0:r1, None]
        best_v = torch.full((r1 - r0, topk), float("-inf"), device=q.device)
        best_i = torch.full((r1 - r0, topk), -1, dtype=torch.long, device=q.device)
        for t0 in range(0, end, kv_tile):
            t1 = min(t0 + kv_tile, end)
            sc = torch.einsum("shd,td->sht", qf, k[t0:t1].float())
            sc = (F.relu(sc) * w[:, :, None]).sum(dim=1)  # [rows, tile]
            idx = torch.arange(t0, t1, device=q.device)
            sc = sc.masked_fill(idx[None, :] >= ends, float("-inf"))
            cand_v = torch.cat([best_v, sc], dim=1)
            cand_i = torch.cat([best_i, idx[None, :].expand(r1 - r0, -1)], dim=1)
            kk = min(topk, cand_v.shape[1])
            top_v, pos = cand_v.topk(kk, dim=1)
            best_v[:, :kk] = top_v
            best_i[:, :kk] = cand_i.gather(1, pos)
        out[r0:r1] = torch.where(torch.isinf(best_v), -1, best_i)
    return out

def select_topk(
    backend: V4Backend, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
    kv_end: torch.Tensor, topk: int, ws: object | None,
) -> torch.Tensor:
    """Indices [C, topk] (-1 = none) of the best visible entries per query row.
    q: [C, Hi, Di], keys: [E, Di], weights: [C, Hi] fp32 (scales folded), kv_end: [C] int."""
    kind = backend.indexer
    if kind == "torch":
        return indexer_topk_torch(q, keys, weights, kv_end, topk)
    if kind == "naive":
        from kernels.indexer_topk_ref import indexer_topk_naive

        out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
        if keys.shape[0] == 0:
            return out
        idx = indexer_topk_naive(q, keys, weights, kv_end.to(torch.int32), topk)
        # torch.topk also returns masked (-inf) entries when fewer are visible: drop them.
        idx = torch.where(idx < kv_end[:, None], idx, -1)
        out[:, : idx.shape[1]] = idx
        return out
    kv_end32 = kv_end.to(torch.int32)
    if kind == "kernels_ref":
        from kernels.indexer_topk_ref import indexer_topk_ref

        return indexer_topk_ref(q, keys, weights, kv_end32, topk)[1]
    from kernels.indexer_topk import indexer_topk, indexer_topk_workspace_bytes

    rows, heads, dim = q.shape
    if ws is None:
        return indexer_topk(q, keys.contiguous(), weights, kv_end32, topk)[1]
    need = indexer_topk_workspace_bytes(rows, heads, dim, keys.shape[0], topk)
    scratch = ws.take((need,), torch.uint8, caller="deepseek_v4.indexer_topk")  # type: ignore[attr-defined]
    out_idx = ws.take((rows, topk), torch.int32, caller="deepseek_v4.indexer_topk.indices")  # type: ignore[attr-defined]
    out_sc = ws.take((rows, topk), torch.float32, caller="deepseek_v4.indexer_topk.scores")  # type: ignore[attr-defined]
    return indexer_topk(q, keys, weights, kv_end32, topk, out_indices=out_idx, out_scores=out_sc,
                        workspace=scratch)[1]
