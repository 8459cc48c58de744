"""kernels.sinkhorn against kernels.sinkhorn_ref (m = 1..6 including non-powers of two, the
iteration counts DeepSeek-V4 uses). CPU tier through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.sinkhorn import sinkhorn
from kernels.sinkhorn_ref import sinkhorn_ref


@pytest.mark.parametrize("n,m,iters", [(1, 4, 20), (7, 3, 5), (5, 6, 1), (2, 1, 3), (33, 4, 2)])
def test_sinkhorn_matches_reference(interpret, n, m, iters):
    g = torch.Generator().manual_seed(n * 10 + m)
    logits = 3 * torch.randn(n, m, m, generator=g)
    out = torch.full_like(logits, float("nan"))
    sinkhorn(logits, iters, 1e-6, out)
    torch.testing.assert_close(out, sinkhorn_ref(logits, iters, 1e-6), rtol=1e-5, atol=1e-6)


def test_sinkhorn_names_the_bad_argument(interpret):
    with pytest.raises(KernelArgumentError, match="logits"):
        sinkhorn(torch.zeros(2, 3, 4), 3, 1e-6, torch.zeros(2, 3, 4))
    with pytest.raises(KernelArgumentError, match="iters"):
        sinkhorn(torch.zeros(2, 3, 3), 0, 1e-6, torch.zeros(2, 3, 3))


@pytest.mark.gpu
def test_sinkhorn_on_cuda(cuda):
    logits = 3 * torch.randn(4096, 4, 4, device="cuda")
    out = torch.empty_like(logits)
    sinkhorn(logits, 20, 1e-6, out)
    torch.testing.assert_close(out, sinkhorn_ref(logits, 20, 1e-6), rtol=1e-5, atol=1e-6)
