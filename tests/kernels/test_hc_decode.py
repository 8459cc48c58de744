"""kernels.hc_decode (merge + mHC pre-mix + Sinkhorn + collapse + RMSNorm, fused for decode)
against kernels.hc_decode_ref on awkward shapes: m = 1..5, hidden not a multiple of the kernel's
slices, strided stream rows, with and without the merge, the final head. CPU tier through the
Triton interpreter; gpu tier in bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.hc_decode import hc_decode, hc_decode_partial_shape
from kernels.hc_decode_ref import hc_decode_ref


def _inputs(n: int, m: int, d: int, head: bool, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = m if head else (2 + m) * m
    wide = torch.randn(n, m, d + 5, generator=g).to(device, dtype)  # strided rows
    p = dict(
        streams=wide[..., :d],
        fn=(torch.randn(rows, m * d, generator=g) / (m * d) ** 0.5).to(device),
        base=(0.3 * torch.randn(rows, generator=g)).to(device),
        scale=(1 + 0.2 * torch.randn(1 if head else 3, generator=g)).to(device),
        norm_weight=(1 + 0.1 * torch.randn(d, generator=g)).to(device),
    )
    merge = ((2 * torch.rand(n, m, generator=g)).to(device),
             torch.rand(n, m, m, generator=g).to(device),
             torch.randn(n, d, generator=g).to(device, dtype))
    return p, merge


def _run(p: dict, merge, head: bool, iters: int = 5):
    n, m, d = p["streams"].shape
    dev, dt = p["streams"].device, p["streams"].dtype
    out = dict(partial=torch.full(hc_decode_partial_shape(n, m, d, head), float("nan"), device=dev),
               x=torch.full((n, d), float("nan"), dtype=dt, device=dev))
    if not head:
        out |= dict(post=torch.full((n, m), float("nan"), device=dev),
                    comb=torch.full((n, m, m), float("nan"), device=dev))
    merged = torch.full((n, m, d), float("nan"), dtype=dt, device=dev) if merge else None
    s = hc_decode(**p, iters=iters, hc_eps=1e-6, norm_eps=1e-6, **out, merge=merge,
                  merged=merged, head=head)
    return s, out


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("with_merge", [False, True])
@pytest.mark.parametrize("n,m,d", [(1, 4, 64), (3, 3, 100), (2, 1, 17), (5, 5, 130)])
def test_hc_decode_matches_reference(interpret, n, m, d, with_merge, head):
    p, merge = _inputs(n, m, d, head, torch.float32, "cpu", seed=n * 100 + m * 10 + d)
    s, out = _run(p, merge if with_merge else None, head)
    ref_s, post, comb, x = hc_decode_ref(**p, iters=5, hc_eps=1e-6, norm_eps=1e-6,
                                         merge=merge if with_merge else None, head=head)
    torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["x"], x, rtol=1e-4, atol=1e-4)
    if not head:
        torch.testing.assert_close(out["post"], post, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["comb"], comb, rtol=1e-5, atol=1e-5)
        # Sinkhorn's result is (nearly) doubly stochastic: a check the reference cannot share
        torch.testing.assert_close(out["comb"].sum(-2), torch.ones(n, m), rtol=1e-3, atol=1e-3)


def test_hc_decode_names_the_bad_argument(interpret):
    p, merge = _inputs(2, 4, 16, False, torch.float32, "cpu", 0)
    with pytest.raises(KernelArgumentError, match="fn"):
        _run(p | {"fn": p["fn"][:, :-1]}, None, False)
    with pytest.raises(KernelArgumentError, match="post"):
        hc_decode(**p, iters=3, hc_eps=1e-6, norm_eps=1e-6, partial=torch.empty(2, 1, 26),
                  x=torch.empty(2, 16))
    with pytest.raises(KernelArgumentError, match="merged"):
        hc_decode(**p, iters=3, hc_eps=1e-6, norm_eps=1e-6, partial=torch.empty(2, 1, 26),
                  x=torch.empty(2, 16), post=torch.empty(2, 4), comb=torch.empty(2, 4, 4),
                  merge=merge, merged=p["streams"])
    with pytest.raises(KernelArgumentError, match="iters"):
        _run(p, None, False, iters=0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,m,d", [(1, 4, 4096), (32, 4, 4096), (3, 3, 1000)])
def test_hc_decode_on_cuda(cuda, n, m, d):
    p, merge = _inputs(n, m, d, False, torch.bfloat16, "cuda", seed=d)
    s, out = _run(p, merge, False, iters=20)
    ref_s, post, comb, x = hc_decode_ref(**p, iters=20, hc_eps=1e-6, norm_eps=1e-6, merge=merge)
    torch.testing.assert_close(s.float(), ref_s.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(out["post"], post, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out["comb"], comb, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out["x"].float(), x.float(), rtol=3e-2, atol=3e-2)
