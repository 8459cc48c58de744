"""PyTorch reference (the specification) of ``kernels.indexer_decode``: the lightning indexer's
scores of one decode query per row over a tile of that row's own compressed entries, read from
a paged pool through the row's block table (DeepSeek-V4, CSA layers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def indexer_decode_scores_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                              tables: torch.Tensor, kv_end: torch.Tensor, first: int, num: int,
                              per_block: int, key_scale: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """q [B, H, D]; weights [B, H] fp32 (softmax scales folded in); keys [rows, D]: the pool's
    flat entry rows (entry i of a sequence is row ``table[i // per_block] * per_block + i %
    per_block``); tables [B, blocks] int64; kv_end [B] int64 (row b sees entries < kv_end[b]).
    Entries ``[first, first + num)`` -> scores [B, num] fp32, ``sum_h w[h] * relu(q[h] . k)``
    in fp32, ``-inf`` where not visible. ``key_scale`` [rows] fp32: FP8 keys, each row its
    stored values x its scale."""
    e = torch.arange(first, first + num, device=q.device)
    rows = tables.gather(1, (e // per_block)[None, :].expand(q.shape[0], -1)) * per_block
    flat = rows + e % per_block
    k = keys[flat].float()  # [B, T, D]
    if key_scale is not None:
        k = k * key_scale[flat][..., None]
    sc = torch.einsum("bhd,btd->bht", q.float(), k)
    sc = (F.relu(sc) * weights[:, :, None]).sum(dim=1)
    return sc.masked_fill(e[None, :] >= kv_end[:, None], float("-inf"))


def indexer_decode_topk_ref(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                            tables: torch.Tensor, kv_end: torch.Tensor, per_block: int,
                            topk: int, key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The ``topk`` best entries of each row over its whole table -> [B, topk] int64, best
    first, ties to the lower entry, -1 past the visible ones."""
    num = tables.shape[1] * per_block
    sc = indexer_decode_scores_ref(q, weights, keys, tables, kv_end, 0, num, per_block, key_scale)
    e = torch.arange(num, device=q.device)
    # order by score descending, then entry ascending (a stable sort of the entries)
    order = torch.sort(sc, dim=1, descending=True, stable=True).indices[:, :topk]
    out = torch.where(torch.isinf(sc.gather(1, order)), -1, e[order])
    return torch.nn.functional.pad(out, (0, topk - out.shape[1]), value=-1)


def entry_pool_rows_ref(entries: torch.Tensor, tables: torch.Tensor, per_block: int) -> torch.Tensor:
    """Entry numbers [B, K] (-1: none) -> their flat pool rows, int32, -1 kept."""
    e = entries.clamp(min=0)
    rows = tables.gather(1, e // per_block) * per_block + e % per_block
    return torch.where(entries >= 0, rows, -1).to(torch.int32)
