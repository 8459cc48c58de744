"""kernels.hc_streams (mHC merge and collapse) against kernels.hc_streams_ref on awkward shapes
(m = 1..6, hidden not a power of two or a multiple of the kernel's slice, strided rows). CPU tier
through the Triton interpreter; the gpu tier in bf16 on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.hc_streams import hc_collapse, hc_merge
from kernels.hc_streams_ref import hc_collapse_ref, hc_merge_ref


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
