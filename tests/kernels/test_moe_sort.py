"""The MoE's counting sorts on the device (``_mxfp4_moe_triton.launch_moe_sort``): the all-pairs
sort and the tiled prefill-sized one, against ``torch.sort(stable=True)``."""

from __future__ import annotations

import pytest
import torch


def test_device_sort_is_torch_stable_sort(interpret) -> None:
    """The counting sort the GEMMs read: several i-blocks, repeats, empty experts."""
    from kernels._mxfp4_moe_triton import launch_moe_sort

    e = 9
    ids = torch.randint(0, e - 2, (301,), generator=torch.Generator().manual_seed(3))
    order, row_end = torch.full((301,), -1, dtype=torch.int64), torch.zeros(e, dtype=torch.int32)
    launch_moe_sort(ids, order, row_end, e)
    assert torch.equal(order, torch.sort(ids, stable=True).indices)
    assert torch.equal(row_end, torch.searchsorted(ids.sort().values, torch.arange(e), right=True).int())


@pytest.mark.parametrize("pairs,e", [(1024, 9), (1537, 130), (3000, 256)])
def test_tiled_sort_is_torch_stable_sort(interpret, pairs, e) -> None:
    """The prefill-sized counting sort (tiles of 128 pairs, a scan over tiles, ranks within a
    tile): a partial last tile, expert counts not a power of two or above one compare tile,
    experts with no pairs, heavy repeats; the all-pairs sort gives the same answer."""
    from kernels._mxfp4_moe_triton import launch_moe_sort
    from kernels.moe_sort_sizes import sort_scratch_numel

    g = torch.Generator().manual_seed(pairs)
    ids = torch.randint(0, max(1, e - 3), (pairs,), generator=g)
    ids[: pairs // 3] = 2  # one expert takes a third of the pairs, across several tiles
    want_order = torch.sort(ids, stable=True).indices
    want_end = torch.searchsorted(ids.sort().values, torch.arange(e), right=True).int()
    counts = torch.full((sort_scratch_numel(pairs, e),), -7, dtype=torch.int32)
    order, row_end = torch.full((pairs,), -1, dtype=torch.int64), torch.zeros(e, dtype=torch.int32)
    launch_moe_sort(ids, order, row_end, e, counts)
    assert torch.equal(order, want_order) and torch.equal(row_end, want_end)
    order2, row_end2 = torch.full_like(order, -1), torch.zeros_like(row_end)
    launch_moe_sort(ids, order2, row_end2, e)  # the all-pairs sort
    assert torch.equal(order2, want_order) and torch.equal(row_end2, want_end)


def test_tiled_sort_drops_ids_out_of_range(interpret) -> None:
    """An id outside [0, E) is neither counted nor written, as in the all-pairs sort."""
    from kernels._mxfp4_moe_triton import launch_moe_sort
    from kernels.moe_sort_sizes import sort_scratch_numel

    e, pairs = 5, 1100
    ids = torch.randint(0, e, (pairs,), generator=torch.Generator().manual_seed(0))
    ids[10], ids[700] = e, -1
    counts = torch.zeros(sort_scratch_numel(pairs, e), dtype=torch.int32)
    order, row_end = torch.full((pairs,), -1, dtype=torch.int64), torch.zeros(e, dtype=torch.int32)
    launch_moe_sort(ids, order, row_end, e, counts)
    ok = (ids >= 0) & (ids < e)
    want = torch.nonzero(ok).flatten()[torch.sort(ids[ok], stable=True).indices]
    assert int(row_end[-1]) == pairs - 2
    assert torch.equal(order[: pairs - 2], want) and torch.equal(order[pairs - 2:], torch.tensor([-1, -1]))
