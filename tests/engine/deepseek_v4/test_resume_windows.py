"""The window snapshots beside the V4 blocks (engine/models/deepseek_v4/memory/resume_windows.py) as
plain bookkeeping: which block end a step snapshots, which rows it writes, LRU reuse of slabs,
a rewritten block losing its snapshot, and the export / import of one resume point."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.memory.resume_windows import ResumeWindows

W, D, BS = 6, 5, 8  # an awkward window (not dividing the block) and row width


def _windows(num_slabs: int = 3, fp8: bool = False) -> ResumeWindows:
    return ResumeWindows(2, num_slabs, W, D, torch.float32, fp8, torch.device("cpu"))


def _step(rw: ResumeWindows, table: list[int], start: int, n: int, slot: int = 0) -> torch.Tensor:
    """One step of ``n`` tokens from ``start``: the window keys are the positions themselves
    (row p = [p, p, ...]), so what lands in a slab says which positions it holds."""
    num_prev = min(start, W - 1)
    window_kv = torch.arange(start - num_prev, start + n, dtype=torch.float32)[:, None].expand(-1, D)
    rw.plan_step(slot, table, start, n, BS)
    for layer in range(2):
        rw.write(layer, slot, window_kv)
    return window_kv


def _restored(rw: ResumeWindows, block: int, end: int) -> list[float]:
    rings = [torch.full((W, D), -1.0) for _ in range(2)]
    rw.restore(block, end, rings)
    assert torch.equal(rings[0], rings[1])
    return [float(rings[0][p % W, 0]) for p in range(max(0, end - W), end)]


def test_a_step_snapshots_only_the_last_block_end_it_reaches() -> None:
    rw = _windows()
    table = [11, 12, 13, 14]
    _step(rw, table, 0, 27)  # crosses block ends 8, 16, 24: only 24 is kept
    assert [rw.has(b) for b in table] == [False, False, True, False]
    assert _restored(rw, 13, 24) == [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]
    _step(rw, table, 27, 1)  # a decode step inside a block: nothing new
    assert [rw.has(b) for b in table] == [False, False, True, False]
    _step(rw, table, 28, 4)  # reaches 32: its window includes 3 rows from before the step
    assert _restored(rw, 14, 32) == [26.0, 27.0, 28.0, 29.0, 30.0, 31.0]


def test_short_prefix_window_and_missing_snapshot() -> None:
    rw = _windows()
    _step(rw, [5, 6], 0, 8)
    assert _restored(rw, 5, 8) == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    with pytest.raises(InvalidRequest, match="no window snapshot for block 6"):
        _restored(rw, 6, 16)


def test_slabs_are_reused_least_recently_used_first_and_rewrites_forget() -> None:
    rw = _windows(num_slabs=3)
    for slot, block in enumerate((1, 2, 3)):
        _step(rw, [block], 0, 8, slot=slot)
    _restored(rw, 1, 8)  # block 1 used again: block 2 is now the least recent
    _step(rw, [4], 0, 8)
    assert (rw.has(1), rw.has(2), rw.has(3), rw.has(4)) == (True, False, True, True)
    # block 3 handed to another sequence: writing its first token drops its old window
    _step(rw, [3], 0, 5)
    assert not rw.has(3)


@pytest.mark.parametrize("fp8", [False, True])
def test_export_import_one_resume_point(fp8: bool) -> None:
    src, dst = _windows(fp8=fp8), _windows(fp8=fp8)
    _step(src, [7, 8], 0, 16)
    assert src.export_one(7) is None  # no snapshot there: nothing to send
    data = src.export_one(8)
    assert data is not None and data.dtype == torch.uint8 and data.shape == (src.section_bytes,)
    _step(dst, [3, 4], 0, 8)  # block 3 has a snapshot of its own; block 4 gets src's
    dst.import_one(4, data)
    assert (dst.has(3), dst.has(4)) == (True, True)
    assert _restored(dst, 4, 16) == _restored(src, 8, 16)
    assert torch.equal(dst.export_one(4), data)
    dst.forget([3, 4])  # what a block import does to the blocks it overwrites
    assert (dst.has(3), dst.has(4)) == (False, False)
    with pytest.raises(InvalidRequest, match="window snapshot of"):
        dst.import_one(4, data[:-1])
