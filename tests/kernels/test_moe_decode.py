"""kernels.moe_decode (routing; clamped SwiGLU) against kernels.moe_decode_ref: every scoring
function, score- and hash-routed, expert counts not powers of two, k = 1 and k = E, values past
the SwiGLU's clamp. CPU tier through the Triton interpreter; gpu tier in bf16 at V4-Flash's
widths."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.moe_decode import clamped_swiglu, moe_route
from kernels.moe_decode_ref import clamped_swiglu_ref, moe_route_ref


def _route(logits, k, scoring, hashed, g):
    n, e = logits.shape
    kw = {}
    if hashed:
        kw = dict(hash_table=torch.randint(0, e, (50, k), generator=g).to(logits.device),
                  token_ids=torch.randint(0, 50, (n,), generator=g).to(logits.device))
    else:
        kw = dict(bias=(0.1 * torch.randn(e, generator=g)).to(logits.device))
    want_w, want_e = moe_route_ref(logits, k, scoring, 1.5, **kw)
    w = torch.full((n, k), float("nan"), device=logits.device)
    ex = torch.full((n, k), -1, dtype=torch.long, device=logits.device)
    moe_route(logits, k, scoring, 1.5, weights=w, experts=ex, **kw)
    # the same set of experts (torch.topk(sorted=False) leaves their order open), same weights
    ow, oe = want_e.sort(dim=1)
    gw, ge = ex.sort(dim=1)
    assert torch.equal(ow, gw)
    return w.gather(1, ge), want_w.gather(1, oe)


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("n,e,k", [(1, 8, 6), (5, 37, 3), (3, 6, 6), (2, 5, 1)])
def test_moe_route_matches_reference(interpret, n, e, k, scoring, hashed):
    g = torch.Generator().manual_seed(n * 100 + e + k)
    logits = 3 * torch.randn(n, e, generator=g)
    got, want = _route(logits, k, scoring, hashed, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,c", [(1, 16), (3, 100), (2, 1500)])
def test_clamped_swiglu_matches_reference(interpret, n, c):
    g = torch.Generator().manual_seed(c)
    gate, up = 8 * torch.randn(n, c, generator=g), 8 * torch.randn(n, c, generator=g)
    out = torch.full((n, c), float("nan"))
    clamped_swiglu(gate, up, 7.0, out)
    torch.testing.assert_close(out, clamped_swiglu_ref(gate, up, 7.0), rtol=1e-5, atol=1e-5)


def test_moe_decode_names_the_bad_argument(interpret):
    lg = torch.randn(2, 8)
    w, ex = torch.empty(2, 3), torch.empty(2, 3, dtype=torch.long)
    with pytest.raises(KernelArgumentError, match="top_k"):
        moe_route(lg, 9, "sigmoid", 1.0, weights=torch.empty(2, 9),
                  experts=torch.empty(2, 9, dtype=torch.long), bias=torch.zeros(8))
    with pytest.raises(KernelArgumentError, match="scoring"):
        moe_route(lg, 3, "relu", 1.0, weights=w, experts=ex, bias=torch.zeros(8))
    with pytest.raises(KernelArgumentError, match="bias"):
        moe_route(lg, 3, "sigmoid", 1.0, weights=w, experts=ex)
    with pytest.raises(KernelArgumentError, match="token_ids"):
        moe_route(lg, 3, "sigmoid", 1.0, weights=w, experts=ex,
                  hash_table=torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(KernelArgumentError, match="up"):
        clamped_swiglu(lg, lg[:, :4], 1.0, lg.clone())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 32])
def test_moe_decode_on_cuda(cuda, n):
    g = torch.Generator().manual_seed(n)
    logits = (2 * torch.randn(n, 256, generator=g)).to("cuda", torch.bfloat16)
    got, want = _route(logits, 6, "sqrtsoftplus", False, g)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    gate = (8 * torch.randn(n, 2048, generator=g)).to("cuda", torch.bfloat16)
    up = (8 * torch.randn(n, 2048, generator=g)).to("cuda", torch.bfloat16)
    out = torch.empty_like(gate)
    clamped_swiglu(gate, up, 10.0, out)
    torch.testing.assert_close(out, clamped_swiglu_ref(gate, up, 10.0), rtol=1.6e-2, atol=2e-2)
