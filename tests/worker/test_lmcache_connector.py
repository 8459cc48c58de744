"""PagedKVConnector against a plain per-token loop (the specification), on awkward shapes:
odd head_dim, GQA, block ids out of order, ranges that start and end mid-block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from worker.lmcache_connector import PagedKVConnector
from worker.paged_kv import scatter_tokens, token_slots


def reference_gather(paged: torch.Tensor, block_ids: list[int], start: int, end: int
                     ) -> torch.Tensor:
    # paged: [L, 2, NB, BS, H, D] -> [2, L, n, H * D]
    bs = paged.shape[3]
    rows = [paged[:, :, block_ids[i // bs], i % bs].flatten(2) for i in range(start, end)]
    return torch.stack(rows, dim=2).transpose(0, 1).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, start, end", [(16, 0, 16), (16, 5, 37), (4, 13, 14),
                                                    (7, 0, 45)])
def test_gather_and_scatter_match_the_reference(dtype: torch.dtype, block_size: int, start: int,
                                                end: int) -> None:
    num_layers, heads, dim, num_blocks = 3, 2, 13, 12
    g = torch.Generator().manual_seed(block_size * 100 + start)
    paged = torch.randn(num_layers, 2, num_blocks, block_size, heads, dim, generator=g).to(dtype)
    block_ids = torch.randperm(num_blocks - 1, generator=g)[: -(-end // block_size)] + 1
    block_ids = block_ids.tolist()
    conn = PagedKVConnector(num_layers, heads, dim)
    obj = SimpleNamespace(tensor=torch.empty(tuple(conn.get_shape(end - start)), dtype=dtype))
    conn.from_gpu(obj, start, end, kv_data=paged, block_ids=block_ids)
    assert torch.equal(obj.tensor, reference_gather(paged, block_ids, start, end))

    target = torch.zeros_like(paged)
    conn.to_gpu(obj, start, end, kv_data=target, block_ids=block_ids)
    assert torch.equal(reference_gather(target, block_ids, start, end), obj.tensor)
    # Nothing outside tokens [start, end) of this sequence was written.
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[token_slots(block_ids, block_size, start, end, torch.device("cpu"))] = True
    untouched = target.view(num_layers, 2, -1, heads, dim)[:, :, ~written]
    assert not untouched.any()


def test_scatter_skips_tokens_the_engine_already_holds() -> None:
    conn = PagedKVConnector(1, 1, 4)
    obj = SimpleNamespace(tensor=torch.arange(2 * 1 * 10 * 4, dtype=torch.float32)
                          .view(2, 1, 10, 4))
    target = torch.full((1, 2, 4, 4, 1, 4), -1.0)
    conn.to_gpu(obj, 6, 16, kv_data=target, block_ids=[3, 1, 2, 0], skip_tokens=9)
    got = reference_gather(target, [3, 1, 2, 0], 6, 16)
    assert (got[:, :, :3] == -1).all()  # tokens 6..8 untouched
    assert torch.equal(got[:, :, 3:], obj.tensor[:, :, 3:])
    conn.to_gpu(obj, 6, 16, kv_data=target, block_ids=[3, 1, 2, 0], skip_tokens=16)


def test_scatter_of_a_staged_fetch() -> None:
    g = torch.Generator().manual_seed(3)
    staged = torch.randn(2, 2, 1, 23, 3, 5, generator=g)  # what KVStore.fetch returns
    target = torch.zeros(2, 2, 9, 4, 3, 5)
    block_ids = [8, 2, 5, 1, 7, 3]
    scatter_tokens(target, block_ids, 6, 21, staged)
    got = reference_gather(target, block_ids, 0, 23)  # [2, L, n, H * D]
    want = staged[:, :, 0].flatten(3).transpose(0, 1)
    assert torch.equal(got[:, :, 6:21], want[:, :, 6:21])
    assert not got[:, :, :6].any() and not got[:, :, 21:].any()


def test_bad_inputs_are_named() -> None:
    conn = PagedKVConnector(2, 2, 8)
    obj = SimpleNamespace(tensor=torch.empty(2, 2, 4, 16))
    with pytest.raises(TypeError, match="block_ids"):
        conn.from_gpu(obj, 0, 4, kv_data=torch.zeros(2, 2, 4, 4, 2, 8))
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        conn.from_gpu(obj, 0, 4, kv_data=torch.zeros(2, 2, 4, 4, 1, 8), block_ids=[1])
    with pytest.raises(ValueError, match="block table has 1"):
        conn.from_gpu(obj, 0, 8, kv_data=torch.zeros(2, 2, 4, 4, 2, 8), block_ids=[1])
