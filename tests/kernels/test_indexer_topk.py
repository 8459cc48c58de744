"""indexer_topk (Triton, interpreted on CPU) against indexer_topk_ref on awkward shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels import (
    IndexerTiles,
    KernelArgumentError,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_workspace_bytes,
)

SMALL = IndexerTiles(tile_w=64, block_m=16, block_n=32)


def _inputs(s, h, d, t, *, integer, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    if integer:  # exact arithmetic, so ties are real and the tie-break decides
        q = torch.randint(-2, 3, (s, h, d), generator=g).to(dtype)
        k = torch.randint(-2, 3, (t, d), generator=g).to(dtype)
        w = torch.randint(-2, 3, (s, h), generator=g).float()
    else:
        q = torch.randn(s, h, d, generator=g).to(dtype)
        k = torch.randn(t, d, generator=g).to(dtype)
        w = torch.randn(s, h, generator=g)
    kv_end = torch.randint(0, t + 3, (s,), generator=g, dtype=torch.int32)
    return q, k, w, kv_end


@pytest.mark.parametrize(
    ("s", "h", "d", "t", "topk", "integer"),
    [
        (7, 3, 20, 50, 16, True),  # several tiles, odd sizes, non-pow2 heads
        (5, 5, 33, 150, 20, True),  # topk not a power of two; candidate overflow merges
        (4, 2, 16, 10, 40, True),  # T < topk: -1 / -inf padding
        (9, 1, 16, 97, 8, False),  # random values, one head
        (3, 4, 24, 130, 64, False),  # topk > tile contents per tile
    ],
)
def test_matches_reference(interpret, s, h, d, t, topk, integer) -> None:
    q, k, w, kv_end = _inputs(s, h, d, t, integer=integer, seed=s * 1000 + t)
    ref_s, ref_i = indexer_topk_ref(q, k, w, kv_end, topk)
    out_s = torch.full((s, topk), 123.0)
    out_i = torch.full((s, topk), -7, dtype=torch.int32)
    got_s, got_i = indexer_topk(q, k, w, kv_end, topk, out_indices=out_i, out_scores=out_s,
                                tiles=SMALL)
    assert got_i is out_i and got_s is out_s
    assert torch.equal(got_i, ref_i)
    torch.testing.assert_close(got_s, ref_s, rtol=1e-5, atol=1e-4)


def test_all_zero_scores_break_ties_by_lowest_index(interpret) -> None:
    s, h, d, t, topk = 4, 3, 16, 70, 16
    q, k, _, _ = _inputs(s, h, d, t, integer=True, seed=1)
    w = -torch.ones(s, h)  # negative weights on zero dot products give -0.0: same value as 0
    q[:, :, :] = 0
    kv_end = torch.tensor([70, 5, 0, 33], dtype=torch.int32)
    got_s, got_i = indexer_topk(q, k, w, kv_end, topk, tiles=SMALL)
    ref_s, ref_i = indexer_topk_ref(q, k, w, kv_end, topk)
    assert torch.equal(got_i, ref_i)
    assert got_i[0].tolist() == list(range(16))
    assert got_i[1].tolist() == list(range(5)) + [-1] * 11
    assert got_i[2].tolist() == [-1] * 16
    assert torch.isinf(got_s[2]).all()


def test_one_tile_equals_many_tiles(interpret) -> None:
    q, k, w, kv_end = _inputs(6, 2, 16, 200, integer=True, seed=7)
    a = indexer_topk(q, k, w, kv_end, 32, tiles=IndexerTiles(tile_w=256, block_m=16, block_n=32))
    b = indexer_topk(q, k, w, kv_end, 32, tiles=SMALL)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_workspace_is_flat_in_context_length() -> None:
    sizes = {indexer_topk_workspace_bytes(4096, 64, 128, t, 512) for t in (16384, 65536, 262144)}
    assert len(sizes) == 1
    (size,) = sizes
    assert size < 512 * 1024**2
    assert indexer_topk_workspace_bytes(4096, 64, 128, 100, 512) < size


def test_rejects_bad_arguments(interpret) -> None:
    q, k, w, kv_end = _inputs(4, 2, 16, 40, integer=True, seed=3)
    with pytest.raises(KernelArgumentError, match="workspace"):
        indexer_topk(q, k, w, kv_end, 8, workspace=torch.empty(10, dtype=torch.uint8),
                     tiles=SMALL)
    with pytest.raises(KernelArgumentError, match="'k'"):
        indexer_topk(q, k[:, :8], w, kv_end, 8)
    with pytest.raises(KernelArgumentError, match="kv_end"):
        indexer_topk(q, k, w, kv_end.long(), 8)
    with pytest.raises(KernelArgumentError, match="topk"):
        indexer_topk(q, k, w, kv_end, 0)


def test_import_does_not_need_triton() -> None:
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_monotone_scores(interpret, order) -> None:
    """Ascending scores make every key a candidate (worst case for the running merge)."""
    s, h, d, t, topk = 3, 2, 16, 150, 16
    q = torch.zeros(s, h, d, dtype=torch.bfloat16)
    q[:, :, 0] = 1
    k = torch.zeros(t, d, dtype=torch.bfloat16)
    ramp = torch.arange(t) if order == "ascending" else t - torch.arange(t)
    k[:, 0] = (ramp % 256).to(torch.bfloat16)  # exact integers in bf16 up to 256
    w = torch.ones(s, h)
    kv_end = torch.tensor([150, 77, 16], dtype=torch.int32)
    got = indexer_topk(q, k, w, kv_end, topk, tiles=SMALL)
    ref = indexer_topk_ref(q, k, w, kv_end, topk)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])


@pytest.mark.parametrize("integer", [True, False])
def test_fp8_with_scales_matches_reference(interpret, integer) -> None:
    s, h, d, t, topk = 6, 3, 32, 90, 16
    q, k, w, kv_end = _inputs(s, h, d, t, integer=integer, seed=21, dtype=torch.float32)
    g = torch.Generator().manual_seed(22)
    # power-of-two scales keep integer inputs exact; random ones exercise the general case
    q_scale = 2.0 ** torch.randint(-3, 3, (s, h), generator=g).float()
    k_scale = 2.0 ** torch.randint(-3, 3, (t,), generator=g).float()
    if not integer:
        q_scale *= torch.rand(s, h, generator=g) + 0.5
        k_scale *= torch.rand(t, generator=g) + 0.5
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    got_s, got_i = indexer_topk(q8, k8, w, kv_end, topk, q_scale=q_scale, k_scale=k_scale,
                                tiles=SMALL)
    ref_s, ref_i = indexer_topk_ref(q8, k8, w, kv_end, topk, q_scale=q_scale, k_scale=k_scale)
    assert torch.equal(got_i, ref_i)
    torch.testing.assert_close(got_s, ref_s, rtol=1e-5, atol=1e-4)
    # the factored form equals the definition on dequantised inputs
    deq_s, _ = indexer_topk_ref(q8.float() * q_scale[..., None], k8.float() * k_scale[:, None],
                                w, kv_end, topk)
    torch.testing.assert_close(got_s, deq_s, rtol=1e-4, atol=1e-3)
