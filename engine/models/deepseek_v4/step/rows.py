"""What one attention step works on, by row: the sequences of the flat batch (:class:`SeqSpan`)
and one layer's per-token tensors (:class:`StepRows`). Plain data: no parameters, no cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of the step: tokens ``[begin, end)`` of the flat batch, its cache slot, and
    how many tokens the slot had absorbed before this step (= position of its first token)."""

    begin: int
    end: int
    slot: int
    start_pos: int
    table: torch.Tensor  # [blocks] int64: the sequence's block ids in the pool


@dataclass
class StepRows:
    """Per-token tensors of one layer's step (rows picked by :meth:`select`)."""

    q: torch.Tensor  # [N, H, D] rotated queries
    kv: torch.Tensor | None  # [N, D] rotated shared K=V (None: already in the window ring)
    kv_c: torch.Tensor | None = None  # compressor projections [N, width]
    gate_c: torch.Tensor | None = None
    kv_i: torch.Tensor | None = None  # indexer compressor projections [N, 2 * index_head_dim]
    gate_i: torch.Tensor | None = None
    idx_q: torch.Tensor | None = None  # [N, Hi, Di]
    idx_w: torch.Tensor | None = None  # [N, Hi] fp32
    picks: torch.Tensor | None = None  # [N, topk] int32 pool rows of the indexer's picks (side lane)

    def select(self, index: slice | torch.Tensor) -> StepRows:
        """These rows of every tensor (views for a slice, copies for an index tensor)."""
        return StepRows(**{k: None if v is None else v[index] for k, v in vars(self).items()})
