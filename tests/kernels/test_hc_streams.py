"""kernels.hc_streams (mHC merge and collapse) against kernels.hc_streams_ref on awkward shapes
(m = 1..6, hidden not a power of two or a multiple of the kernel's slice, strided rows). CPU tier
through the Triton interpreter; the gpu tier in bf16 on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.hc_streams import hc_collapse, hc_merge, hc_mixes
from kernels.hc_streams_ref import hc_collapse_ref, hc_merge_ref, hc_mixes_ref


def _inputs(n: int, m: int, d: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    post = (2 * torch.rand(n, m, generator=g)).to(device)
    comb = torch.rand(n, m, m, generator=g).to(device)
    block_out = torch.randn(n, d, generator=g).to(device, dtype)
    # streams as a strided view (rows of a wider buffer), as a slice of a bigger step would be
    wide = torch.randn(n, m, d + 3, generator=g).to(device, dtype)
    return post, comb, block_out, wide[..., :d]


@pytest.mark.parametrize("n,m,d", [(1, 4, 64), (7, 3, 33), (5, 6, 700), (3, 1, 17), (9, 4, 1030)])
def test_hc_merge_matches_reference(interpret, n, m, d):
    post, comb, block_out, streams = _inputs(n, m, d, torch.float32, seed=n + m + d)
    out = torch.full((n, m, d), float("nan"))
    hc_merge(post, comb, block_out, streams, out)
    torch.testing.assert_close(out, hc_merge_ref(post, comb, block_out, streams), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,m,d", [(1, 4, 64), (7, 3, 33), (5, 6, 700), (2, 1, 5), (9, 4, 1030)])
def test_hc_collapse_matches_reference(interpret, n, m, d):
    pre, _, _, streams = _inputs(n, m, d, torch.float32, seed=n * m + d)
    out = torch.full((n, d), float("nan"))
    hc_collapse(pre, streams, out)
    torch.testing.assert_close(out, hc_collapse_ref(pre, streams), rtol=1e-5, atol=1e-5)


def test_hc_streams_name_the_bad_argument(interpret):
    post, comb, block_out, streams = _inputs(3, 4, 8, torch.float32)
    with pytest.raises(KernelArgumentError, match="comb"):
        hc_merge(post, comb[:, :3], block_out, streams, torch.empty(3, 4, 8))
    with pytest.raises(KernelArgumentError, match="out"):
        hc_merge(post, comb, block_out, streams, streams)
    with pytest.raises(KernelArgumentError, match="streams"):
        hc_collapse(torch.ones(3, 17), torch.ones(3, 17, 8), torch.empty(3, 8))
    with pytest.raises(KernelArgumentError, match="pre"):
        hc_collapse(post.double(), streams, torch.empty(3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("n,m,d", [(4096, 4, 4096), (3, 4, 4096), (5, 3, 1000)])
def test_hc_streams_on_cuda(cuda, n, m, d):
    post, comb, block_out, streams = _inputs(n, m, d, torch.bfloat16, "cuda", seed=d)
    out = torch.empty(n, m, d, dtype=torch.bfloat16, device="cuda")
    hc_merge(post, comb, block_out, streams, out)
    # the kernel rounds once (fp32 inside), the bf16 reference after each product and the sum,
    # which differ by several bf16 steps where terms cancel: compare with the exact value of
    # the same bf16-rounded mixing weights, to within the output's own rounding
    exact = hc_merge_ref(post.bfloat16().float(), comb.bfloat16().float(), block_out.float(),
                         streams.float())
    torch.testing.assert_close(out.float(), exact, rtol=8e-3, atol=1e-2)
    col = torch.empty(n, d, dtype=torch.bfloat16, device="cuda")
    hc_collapse(post, streams, col)
    torch.testing.assert_close(col, hc_collapse_ref(post, streams), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,m,d,rows", [(1, 4, 64, 24), (17, 3, 33, 15), (5, 6, 200, 48),
                                        (3, 1, 17, 1), (40, 4, 130, 4), (16, 2, 64, 8)])
def test_hc_mixes_matches_reference(interpret, n, m, d, rows):
    g = torch.Generator().manual_seed(n + m + d + rows)
    # strided stream rows (a wider buffer), tokens not a multiple of the tile, fn rows padded
    streams = torch.randn(n, m, d + 5, generator=g)[..., :d]
    fn = torch.randn(rows, m * d, generator=g) * 0.05
    out = torch.full((n, rows), float("nan"))
    hc_mixes(streams, fn, 1e-6, out)
    torch.testing.assert_close(out, hc_mixes_ref(streams, fn, 1e-6), rtol=1e-4, atol=1e-5)


def test_hc_mixes_bf16_streams(interpret):
    g = torch.Generator().manual_seed(3)
    streams = torch.randn(20, 4, 96, generator=g).bfloat16()
    fn = torch.randn(24, 4 * 96, generator=g)
    out = hc_mixes(streams, fn, 1e-6, torch.empty(20, 24))
    torch.testing.assert_close(out, hc_mixes_ref(streams, fn, 1e-6), rtol=1e-4, atol=1e-4)


def test_hc_mixes_names_the_bad_argument(interpret):
    streams, fn = torch.ones(3, 4, 8), torch.ones(24, 32)
    with pytest.raises(KernelArgumentError, match="fn"):
        hc_mixes(streams, torch.ones(24, 31), 1e-6, torch.empty(3, 24))
    with pytest.raises(KernelArgumentError, match="fn"):
        hc_mixes(streams, torch.ones(32, 24).t(), 1e-6, torch.empty(3, 24))
    with pytest.raises(KernelArgumentError, match="out"):
        hc_mixes(streams, fn, 1e-6, torch.empty(3, 24, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("n,rows", [(4096, 24), (5, 24), (33, 4)])
def test_hc_mixes_on_cuda(cuda, n, rows):
    """bf16 streams take three bf16 dots of the fp32 weights' parts on the GPU. The tensor
    cores' fp32 accumulation is not IEEE (an H100 measured 5.4-5.7e-5 relative to the fp64
    product at these shapes, 2026-12-05; TF32, which the engine's cuBLAS GEMMs may use, 2.6-3e-4),
    so the bound is 1e-4: well inside TF32's error and over 10x better than the weights' first
    bf16 part alone (1.3-2e-3)."""
    g = torch.Generator().manual_seed(n)
    streams = torch.randn(n, 4, 4096, generator=g).to("cuda", torch.bfloat16)
    fn = (torch.randn(rows, 4 * 4096, generator=g) * 0.02).cuda()
    out = hc_mixes(streams, fn, 1e-6, torch.empty(n, rows, device="cuda"))
    exact = hc_mixes_ref(streams.double(), fn.double(), 1e-6)
    one_part = hc_mixes_ref(streams.double(), fn.bfloat16().double(), 1e-6)
    err = float((out.double() - exact).norm() / exact.norm())
    assert err < 1e-4 and 10 * err < float((one_part - exact).norm() / exact.norm()), err

