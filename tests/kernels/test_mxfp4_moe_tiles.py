"""The MXFP4 MoE's host-side choices: which form and tiles a step takes
(``_mxfp4_moe_tiles``), its split-K, and when the weights are read as int32 words."""

from __future__ import annotations

import torch

from kernels.mxfp4_moe import moe_experts_workspace_bytes


def test_default_moe_form_by_pairs() -> None:
    """Decode steps of up to 64 pairs take the per-pair GEMV form with the gate-up GEMV cut in
    two (the H200 sweep), more pairs the tiled form, unsplit; the workspace holds the gate-up
    partials only where the split is taken."""
    from kernels._mxfp4_moe_tiles import moe_tiles
    from kernels.moe_sort_sizes import GEMV_MAX_PAIRS
    from kernels.mxfp4_moe import moe_splits

    assert moe_tiles(6)[0] == 1 and moe_tiles(GEMV_MAX_PAIRS)[0] == 1
    assert moe_tiles(GEMV_MAX_PAIRS + 1)[0] > 1 and moe_tiles(24576)[0] > 1
    assert moe_splits(6, 4096, 2048) == (2, 1) and moe_splits(GEMV_MAX_PAIRS, 4096, 2048) == (2, 1)
    assert moe_splits(GEMV_MAX_PAIRS + 1, 4096, 2048) == (1, 1)
    assert (moe_experts_workspace_bytes(1, 6, 4096, 2048, 128)
            == moe_experts_workspace_bytes(1, 6, 4096, 2048, 128, splits=(1, 1))
            + 2 * 6 * 2 * 2048 * 4)  # fp32 gate and up partials of two slices
    assert (moe_experts_workspace_bytes(32, 6, 4096, 2048, 128)
            == moe_experts_workspace_bytes(32, 6, 4096, 2048, 128, splits=(1, 1)))


def test_gemv_reads_words_only_where_the_layout_allows() -> None:
    """The per-pair GEMV reads packed weights as int32 words when rows are whole, aligned words
    (the same memory, no copy), and falls back to bytes otherwise."""
    from kernels._mxfp4_weights_triton import _as_words

    w = torch.randint(0, 256, (3, 8, 16), dtype=torch.uint8)
    words = _as_words(w)
    assert words is not None and words.shape == (3, 8, 4) and words.data_ptr() == w.data_ptr()
    assert _as_words(w[:, :, 2:14]) is None  # not word-aligned
    assert _as_words(torch.zeros(3, 8, 6, dtype=torch.uint8)) is None  # rows not whole words
    assert _as_words(w[:, :, :8]) is None or _as_words(w[:, :, :8]).shape == (3, 8, 2)


def test_prefill_tiles_by_rows_an_expert(monkeypatch) -> None:
    """The GPU's prefill tiles (the interpreter has its own): 256-row tiles once the experts'
    mean rows reach ``WIDE_ROWS_PER_EXPERT`` (4096 tokens x top-6 over 128 experts: 192), with the
    down GEMM at its own 128 x 128 tiles; 128-row tiles below (2048 tokens: 96 rows an expert),
    where the down GEMM takes the gate-up's tiles. Every prefill tile runs N-tiles first."""
    import kernels._mxfp4_moe_tiles as moe

    monkeypatch.setattr(moe, "interpreting", lambda: False)
    wide = moe.moe_tiles(4096 * 6, 4096, 128)
    narrow = moe.moe_tiles(2048 * 6, 4096, 128)
    assert wide[0] == 256 and narrow[0] == 128
    assert moe.moe_tiles(4096 * 6, 4096, 256)[0] == 128  # 96 rows an expert over 256 experts
    assert moe.moe_down_tiles(wide)[:2] == (128, 128) and moe.moe_down_tiles(narrow) == narrow
    assert wide[8] == narrow[8] == moe.moe_down_tiles(wide)[8] == 1
    assert moe.moe_tiles(200, 4096, 128)[0] == 16  # a decode step stays on the decode tiles
