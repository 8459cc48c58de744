"""``--previous-kernels`` of the decode benchmarks (``lab.bench.deepseek_v4.decode``,
``profile_decode``): the fused decode loop's kernel choices as they were before the current
ones, put back for the length of a run so one device call can time both."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def _tiled_topk_indexer(q: torch.Tensor, weights: torch.Tensor, keys: Any, rows: Any, rate: int,
                        block_size: int, topk: int) -> torch.Tensor:
    """The fused loop's CSA indexer as it was before ``kernels.indexer_decode_topk``: each
    2,048-entry tile scored by the kernel, the running top-k kept with ``torch.topk``; the
    picks made pool rows (int32, -1 none: what the fused loop's attention takes) by PyTorch
    ops, as they were then."""
    from engine.models.deepseek_v4.step.decode_ops import indexer_topk_decode
    from kernels.indexer_decode import indexer_decode_scores

    per, flat = block_size // rate, keys.data.view(-1, keys.dim)
    score = None
    if keys.scale is None and keys.data.dtype == q.dtype:
        kv_end = rows.memo(("kv_end", rate), lambda: (rows.positions + 1) // rate)

        def score(first: int, num: int) -> torch.Tensor:
            out = torch.empty(q.shape[0], num, dtype=torch.float32, device=q.device)
            return indexer_decode_scores(q, weights, flat, rows.tables, kv_end, first, num, per,
                                         out)

    idx = indexer_topk_decode(q, weights, keys, rows, rate, block_size, topk, score=score)
    return torch.where(idx >= 0, rows.entry_rows(idx.clamp(min=0), per), -1).to(torch.int32)


@contextmanager
def previous_decode_kernels(on: bool) -> Iterator[None]:
    """``--previous-kernels``: the fused decode loop's kernels as they were before this
    session's choices (the FP8 GEMV's unsplit tiled kernel, the MXFP4 experts' tiled form at
    every size, unsplit, the CSA indexer's ``torch.topk`` merge, the sparse attention unsplit), for the
    plan and every step while
    held, so one device call can time both. Patches the choosing points, nothing else."""
    if not on:
        yield
        return
    # the modules themselves (the package re-exports functions of the same names)
    fl, mt = importlib.import_module("kernels.fp8_linear"), importlib.import_module("kernels._mxfp4_moe_tiles")
    att = importlib.import_module("engine.models.deepseek_v4.layers.attention")
    sa = importlib.import_module("kernels.sparse_attention")
    mm = importlib.import_module("kernels.mxfp4_moe")
    saved = (fl.fp8_gemv_variant, mt.GEMV_MAX_PAIRS, att.indexer_topk_fused,
             sa.decode_attention_splits, mm.moe_splits)

    def tiled(m: int, n: int, k: int, block_k: int) -> fl.Fp8GemvVariant | None:
        tiles = fl.fp8_gemv_tiles(m, n, block_k)
        return None if tiles is None else fl.Fp8GemvVariant(tiles)

    fl.fp8_gemv_variant, mt.GEMV_MAX_PAIRS, att.indexer_topk_fused = tiled, 0, _tiled_topk_indexer
    sa.decode_attention_splits = lambda *a, **k: 1
    mm.moe_splits = lambda *a, **k: (1, 1)
    try:
        yield
    finally:
        (fl.fp8_gemv_variant, mt.GEMV_MAX_PAIRS, att.indexer_topk_fused,
         sa.decode_attention_splits, mm.moe_splits) = saved
