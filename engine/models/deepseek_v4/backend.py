"""Which implementation runs V4's two context-sized operations: the indexer's top-k and the
sparse attention core.

* ``torch``: this package's tiled PyTorch code (CPU default; bounded scratch, any device).
* ``kernels``: the kernels package's Triton kernels (CUDA default), scratch taken from the
  engine's Workspace when one is given.
* ``kernels_ref``: the kernels package's PyTorch references (the specification; slow).
* ``naive`` (indexer only): transformers' formulation, one ``[S, H, T]`` fp32 score tensor; it
  exists to show the memory growth the tiled versions remove and must never be the default.

Never decides anything from mutable global state: the choice is a frozen value handed down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.deepseek_v4.indexer import indexer_topk_torch
from engine.models.deepseek_v4.sparse_attention import v4_attention_torch

_INDEXERS = ("auto", "torch", "kernels", "kernels_ref", "naive")
_ATTENTIONS = ("auto", "torch", "kernels", "kernels_ref")


@dataclass(frozen=True)
class V4Backend:
    indexer: str = "auto"
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.indexer not in _INDEXERS:
            raise ValueError(f"V4Backend.indexer={self.indexer!r} not in {_INDEXERS}")
        if self.attention not in _ATTENTIONS:
            raise ValueError(f"V4Backend.attention={self.attention!r} not in {_ATTENTIONS}")

    def resolved(self, device: torch.device) -> V4Backend:
        """'auto' -> 'kernels' on CUDA, 'torch' elsewhere."""
        default = "kernels" if device.type == "cuda" else "torch"
        return V4Backend(
            indexer=default if self.indexer == "auto" else self.indexer,
            attention=default if self.attention == "auto" else self.attention,
        )


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


def attend(
    backend: V4Backend, out: torch.Tensor, q: torch.Tensor, window_kv: torch.Tensor,
    num_prev: int, window: int, sinks: torch.Tensor, scale: float, start_pos: int,
    comp: torch.Tensor | None, comp_rate: int, topk_idx: torch.Tensor | None,
) -> None:
    """Writes V4 attention of one sequence's chunk into ``out [C, H, D]`` (see
    :func:`v4_attention_torch` for the meaning of the arguments)."""
    if backend.attention == "torch":
        out.copy_(v4_attention_torch(q, window_kv, num_prev, window, sinks, scale, start_pos,
                                     comp=comp, comp_rate=comp_rate, topk_idx=topk_idx))
        return
    c = q.shape[0]
    rows = torch.arange(c, device=q.device, dtype=torch.int32)
    w_end = rows + (num_prev + 1)
    w_start = (w_end - window).clamp(min=0)
    kw: dict[str, torch.Tensor] = {}
    if comp is not None:
        kw["compressed_kv"] = comp
        if topk_idx is not None:
            kw["indices"] = topk_idx.to(torch.int32)
        else:
            kw["compressed_start"] = torch.zeros_like(rows)
            kw["compressed_end"] = torch.div(rows + (start_pos + 1), comp_rate, rounding_mode="floor")
    if backend.attention == "kernels_ref":
        from kernels.sparse_attention_ref import sparse_attention_ref as fn
    else:
        from kernels.sparse_attention import sparse_attention as fn
    fn(q, window_kv, w_start, w_end, scale=scale, out=out, sinks=sinks, **kw)
