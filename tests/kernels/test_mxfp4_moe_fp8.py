"""The FP8 (prefill) form of kernels.moe_experts against kernels.mxfp4_moe_ref.moe_experts_fp8_ref:
one token, 3 and 129 tokens, experts with no tokens, a token picking one expert twice, scale
groups of a row several binades apart (the e2m1 -> e4m3 repacking shifts them), and the
switch by size. CPU tier through the Triton interpreter; the last test compiles on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes, uses_fp8
from kernels.mxfp4_moe_ref import moe_experts_fp8_ref, moe_experts_ref, quantize_mxfp4
from tests.kernels.test_mxfp4_moe import pick_experts


def _experts(e: int, hid: int, inter: int, seed: int, spread: bool = False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(e, 2 * inter, hid, generator=g) * 0.1
    b = torch.randn(e, hid, inter, generator=g) * 0.1
    if spread:  # 32-wide groups of one row up to 2**5 apart: exponent shifts in the repacking
        a = a * (2.0 ** torch.randint(-5, 1, (1, 1, hid // 32), generator=g)).repeat_interleave(32, -1)
        b = b * (2.0 ** torch.randint(-5, 1, (1, 1, inter // 32), generator=g)).repeat_interleave(32, -1)
    return (*quantize_mxfp4(a), *quantize_mxfp4(b))


def _run(x, topk_w, topk_ids, weights, dev="cpu", tiles=None):
    t, k = topk_ids.shape
    e, hid, inter = weights[0].shape[0], x.shape[1], weights[2].shape[-1] * 2
    out = torch.full((t, hid), float("nan"), dtype=x.dtype, device=dev)
    ws = torch.empty(moe_experts_workspace_bytes(t, k, hid, inter, e, x.dtype, fp8=True),
                     dtype=torch.uint8, device=dev)
    moe_experts(x, topk_w, topk_ids, *weights, 7.0, out, workspace=ws, fp8=True, fp8_tiles=tiles)
    return out


@pytest.mark.parametrize(("t", "k", "e", "hid", "inter", "ids", "spread", "tiles"), [
    (1, 2, 5, 128, 128, None, False, None),          # one token
    (3, 3, 7, 256, 128, "skewed", True, None),       # most experts get no token; shifted groups
    (3, 3, 7, 256, 128, "skewed", True, (16, 64, 128, 4, 1)),  # a K-tile of a whole group
    (129, 2, 4, 128, 256, "repeat", False, None),    # a token picks one expert twice, partial tile
])
def test_moe_experts_fp8_matches_reference(interpret, t, k, e, hid, inter, ids, spread,
                                           tiles) -> None:
    g = torch.Generator().manual_seed(t * 31 + e)
    weights = _experts(e, hid, inter, t + e, spread)
    x = torch.randn(t, hid, generator=g)
    topk_ids = pick_experts(t, k, e, ids, g)
    topk_w = torch.rand(t, k, generator=g)
    out = _run(x, topk_w, topk_ids, weights, tiles=tiles)
    want = moe_experts_fp8_ref(x, topk_w, topk_ids, *weights, 7.0)
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    exact = moe_experts_ref(x, topk_w, topk_ids, *weights, 7.0)  # the price of FP8 activations
    assert (out - exact).norm() < 0.06 * exact.norm()


def test_fp8_form_suits_prefill_shapes_only() -> None:
    assert uses_fp8(4096, 4096, 2048) and uses_fp8(128, 128, 256)
    assert not uses_fp8(127, 4096, 2048)  # decode and small batches keep the weight-only form
    assert not uses_fp8(4096, 160, 2048)  # hidden not made of 128-wide groups
    fp8 = moe_experts_workspace_bytes(4096, 6, 4096, 2048, 128, fp8=True)
    bf16 = moe_experts_workspace_bytes(4096, 6, 4096, 2048, 128)  # the default form
    assert fp8 < bf16  # one byte a SwiGLU value instead of two, plus the tokens' codes


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [None, (128, 128, 128, 8, 3), (64, 128, 64, 4, 3)])
def test_moe_experts_fp8_on_cuda(cuda, tiles) -> None:
    e, hid, inter, t, k = 16, 512, 256, 300, 6
    weights = tuple(w.cuda() for w in _experts(e, hid, inter, 1, spread=True))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, hid, generator=g).cuda().bfloat16()
    topk_ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices.cuda()
    topk_w = torch.rand(t, k, generator=g).cuda()
    out = _run(x, topk_w, topk_ids, weights, "cuda", tiles)
    want = moe_experts_fp8_ref(x.float(), topk_w, topk_ids, *weights, 7.0)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
