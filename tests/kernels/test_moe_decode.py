"""kernels.moe_decode (routing; clamped SwiGLU) against kernels.moe_decode_ref: every scoring
function, score- and hash-routed, expert counts not powers of two, k = 1 and k = E, values past
the SwiGLU's clamp. CPU tier through the Triton interpreter; gpu tier in bf16 at V4-Flash's
widths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.errors import KernelArgumentError
from kernels.moe_decode import clamped_swiglu, moe_route, moe_router
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


def _router(x, gw, k, scoring, hashed, g, sem=None):
    """moe_router against moe_route_ref of the linear's logits -> (got, want) weights in expert
    order; the experts must be the same set, the counters zero again."""
    n, e = x.shape[0], gw.shape[0]
    dev = x.device
    kw = {}
    if hashed:
        kw = dict(hash_table=torch.randint(0, e, (50, k), generator=g).to(dev),
                  token_ids=torch.randint(0, 50, (n,), generator=g).to(dev))
    else:
        kw = dict(bias=(0.1 * torch.randn(e, generator=g)).to(dev))
    sem = torch.zeros(max(n, 1) + 3, dtype=torch.int32, device=dev) if sem is None else sem
    logits = torch.full((n, e), float("nan"), dtype=x.dtype, device=dev)
    w = torch.full((n, k), float("nan"), device=dev)
    ex = torch.full((n, k), -1, dtype=torch.long, device=dev)
    moe_router(x, gw, k, scoring, 1.5, weights=w, experts=ex, logits=logits, semaphores=sem, **kw)
    lin = F.linear(x, gw)
    tol = dict(rtol=1e-5, atol=1e-5) if x.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(logits, lin, **tol)
    assert not sem.any()
    # fp32: the linear's logits; bf16: the kernel's own (a one-ulp rounding difference from
    # the linear's may reorder a near tie; the logits themselves are checked above)
    want_w, want_e = moe_route_ref(lin if x.dtype == torch.float32 else logits, k, scoring, 1.5,
                                   **kw)
    ow, oe = want_e.sort(dim=1)
    gw_, ge = ex.sort(dim=1)
    assert torch.equal(ow, gw_)
    return w.gather(1, ge), want_w.gather(1, oe)


@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
@pytest.mark.parametrize("n,e,hidden,k", [(1, 8, 32, 6), (5, 37, 700, 3), (3, 6, 100, 6),
                                          (2, 130, 1030, 4)])
def test_moe_router_matches_linear_then_reference(interpret, n, e, hidden, k, scoring, hashed):
    """Expert counts not multiples of a program's group, widths not of the loop's step."""
    g = torch.Generator().manual_seed(n * 1000 + e + hidden)
    x, gw = torch.randn(n, hidden, generator=g), torch.randn(e, hidden, generator=g) / hidden**0.5
    got, want = _router(x, gw, k, scoring, hashed, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_moe_router_counters_are_reusable(interpret):
    """Back to back on one set of counters (as the layers of a step share them): each launch
    routes every row, none sees another's counts."""
    g = torch.Generator().manual_seed(3)
    sem = torch.zeros(8, dtype=torch.int32)
    for n in (4, 1, 6):
        x, gw = torch.randn(n, 64, generator=g), torch.randn(20, 64, generator=g) / 8
        got, want = _router(x, gw, 3, "sqrtsoftplus", False, g, sem=sem)
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
    x, gw = torch.randn(2, 16), torch.randn(8, 16)
    kw = dict(weights=w, experts=ex, logits=torch.empty(2, 8), bias=torch.zeros(8))
    with pytest.raises(KernelArgumentError, match="semaphores"):
        moe_router(x, gw, 3, "sigmoid", 1.0, semaphores=torch.zeros(1, dtype=torch.int32), **kw)
    with pytest.raises(KernelArgumentError, match="semaphores"):
        moe_router(x, gw, 3, "sigmoid", 1.0, semaphores=torch.zeros(4), **kw)
    with pytest.raises(KernelArgumentError, match="gate_weight"):
        moe_router(x, gw[:, :15], 3, "sigmoid", 1.0, semaphores=torch.zeros(4, dtype=torch.int32),
                   **kw)
    with pytest.raises(KernelArgumentError, match="logits"):
        moe_router(x, gw, 3, "sigmoid", 1.0, semaphores=torch.zeros(4, dtype=torch.int32),
                   **(kw | {"logits": torch.empty(2, 7)}))


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
    # the router's linear fused: V4-Flash's width, 256 experts
    x = torch.randn(n, 4096, generator=g).to("cuda", torch.bfloat16)
    gw = (torch.randn(256, 4096, generator=g) / 64).to("cuda", torch.bfloat16)
    got, want = _router(x, gw, 6, "sqrtsoftplus", False, g)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
