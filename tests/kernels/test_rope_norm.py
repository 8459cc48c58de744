"""kernels.rope_norm (RMSNorm + interleaved partial RoPE per head row, rows remapped on the way)
against kernels.rope_norm_ref on awkward shapes: odd head counts, D not a power of two, a rope
width equal to D, duplicate source rows, strided inputs. CPU tier through the Triton interpreter;
gpu tier in bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.rope_norm import rope_norm
from kernels.rope_norm_ref import rope_norm_ref


def _cos_sin(n: int, half: int, dtype: torch.dtype, device: str, g: torch.Generator):
    ang = torch.rand(n, half, generator=g) * 6.28
    return (ang.cos() * 1.1).to(device, dtype), (ang.sin() * 1.1).to(device, dtype)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n,h,d,half", [(1, 1, 8, 2), (3, 5, 70, 8), (2, 3, 24, 12), (4, 0, 33, 4),
                                        (3, 0, 40, 0)])  # half 0: a plain norm (q_a_norm)
def test_rope_norm_in_place_matches_reference(interpret, n, h, d, half, norm, weighted):
    if weighted and not norm:
        pytest.skip("a weight needs the norm")
    g = torch.Generator().manual_seed(n + h + d)
    shape = (n, d) if h == 0 else (n, h, d)
    x = torch.randn(*shape[:-1], d + 3, generator=g)[..., :d]  # strided rows
    cos, sin = _cos_sin(n, half, x.dtype, "cpu", g)
    w = 1 + 0.1 * torch.randn(d, generator=g) if weighted else None
    want = rope_norm_ref(x, cos, sin, norm=norm, weight=w, eps=1e-6)
    got = x.clone()
    rope_norm(got, cos, sin, got, norm=norm, weight=w, eps=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rope_norm_remaps_rows(interpret):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 20, generator=g)
    cos, sin = _cos_sin(4, 6, x.dtype, "cpu", g)
    w = torch.rand(20, generator=g) + 0.5
    src = torch.tensor([0, 2, 2, 0])  # pad rows copy another row, as a CUDA graph's do
    dst = torch.tensor([5, 1, 9, 3])
    ring = torch.full((11, 20), float("nan"))
    rope_norm(x, cos, sin, ring, norm=True, weight=w, eps=1e-6, src_rows=src, dst_rows=dst)
    torch.testing.assert_close(ring[dst], rope_norm_ref(x, cos, sin, norm=True, weight=w,
                                                        eps=1e-6, src_rows=src))
    untouched = torch.ones(11, dtype=torch.bool)
    untouched[dst] = False
    assert ring[untouched].isnan().all()


def test_rope_norm_names_the_bad_argument(interpret):
    x = torch.randn(2, 3, 16)
    cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    with pytest.raises(KernelArgumentError, match="cos"):
        rope_norm(x, torch.ones(2, 9), torch.zeros(2, 9), x, norm=False)
    with pytest.raises(KernelArgumentError, match="weight"):
        rope_norm(x, cos, sin, x, norm=False, weight=torch.ones(16))
    with pytest.raises(KernelArgumentError, match="out"):
        rope_norm(x, cos, sin, x, norm=True, src_rows=torch.tensor([1, 0]))
    with pytest.raises(KernelArgumentError, match="sin"):
        rope_norm(x, cos, sin.double(), x, norm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,d,half", [(1, 64, 512, 32), (32, 64, 512, 32), (3, 1, 512, 32)])
def test_rope_norm_on_cuda(cuda, n, h, d, half):
    g = torch.Generator().manual_seed(d + n)
    x = torch.randn(n, h, d, generator=g).to("cuda", torch.bfloat16)
    cos, sin = _cos_sin(n, half, torch.bfloat16, "cuda", g)
    w = (1 + 0.1 * torch.randn(d, generator=g)).cuda()
    got = x.clone()
    rope_norm(got, cos, sin, got, norm=True, weight=w)
    torch.testing.assert_close(got, rope_norm_ref(x, cos, sin, norm=True, weight=w),
                               rtol=1.6e-2, atol=2e-2)
