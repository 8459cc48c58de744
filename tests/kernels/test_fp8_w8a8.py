"""kernels.fp8_w8a8 against kernels.fp8_w8a8_ref: the activation quantizer gives the reference's
e4m3 codes and scales (every e4m3 code, ties, zeros, -0, subnormals), and the FP8 x FP8 GEMM
matches quantize -> dequantize -> matmul on awkward shapes (M = 1, 3, 129; K not a multiple of
128; partial weight blocks; block-diagonal groups). CPU tier through the Triton interpreter;
the last test compiles for real on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.fp8_linear_ref import fp8_linear_ref
from kernels.fp8_w8a8 import (
    fp8_act_quant,
    fp8_grouped_linear_w8a8,
    fp8_linear_w8a8,
    fp8_w8a8_scratch_bytes,
)
from kernels.fp8_w8a8_ref import (
    fp8_act_dequant_ref,
    fp8_act_quant_ref,
    fp8_grouped_linear_w8a8_ref,
    fp8_linear_w8a8_ref,
)
from tests.kernels.test_fp8_linear import quantize_fp8_block


def _quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, g, k = x.shape
    q = torch.full((m, g, k), 0x7F, dtype=torch.uint8, device=x.device)
    s = torch.full((m, g, -(-k // 128)), float("nan"), device=x.device)
    fp8_act_quant(x, q, s)
    return q, s


@pytest.mark.parametrize(("m", "g", "k"), [(1, 1, 128), (3, 2, 200), (129, 1, 40), (33, 3, 257)])
def test_act_quant_gives_the_reference_codes(interpret, m, g, k) -> None:
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, g, k, generator=gen) * torch.logspace(-6, 3, k)  # subnormal codes too
    x[0, 0, :5] = 0.0
    x[0, 0, 5] = -0.0
    if m > 1:
        x[1] = 0.0  # an all-zero row: zero codes, finite scale
    q, s = _quant(x)
    q_ref, s_ref = fp8_act_quant_ref(x)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q, q_ref.view(torch.uint8))


def test_act_quant_rounds_every_code_and_tie_like_torch(interpret) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).float()
    vals = vals[~vals.isnan()].sort().values
    mids = (vals[1:] + vals[:-1]) / 2  # ties: torch rounds them to the even code
    row = torch.cat([vals, mids, vals * 0.999, vals * 1.001]).clamp(-447.9, 447.9)
    # one group of 128 per row; a 448 in each row pins the scale at exactly 1
    rows = -(-row.numel() // 127)
    body = torch.zeros(rows * 127)
    body[: row.numel()] = row
    x = torch.cat([torch.full((rows, 1), 448.0), body.view(rows, 127)], dim=1).view(rows, 1, 128)
    q, s = _quant(x)
    assert torch.all(s == 1.0)
    assert torch.equal(q, fp8_act_quant_ref(x)[0].view(torch.uint8))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 160), (3, 72, 40), (129, 130, 257), (5, 256, 384)])
def test_fp8_linear_w8a8_matches_reference(interpret, m, n, k) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    q, s = quantize_fp8_block(w, (128, 128))
    out = torch.full((m, n), float("nan"))
    scratch = torch.empty(fp8_w8a8_scratch_bytes(m, k), dtype=torch.uint8)
    fp8_linear_w8a8(x, q, s, out, scratch)
    torch.testing.assert_close(out, fp8_linear_w8a8_ref(x, q, s), rtol=1e-4, atol=1e-4)
    # the price of quantizing the activations, against the weight-only product
    exact = fp8_linear_ref(x, q, s)
    assert (out - exact).norm() < 0.05 * exact.norm()


@pytest.mark.parametrize(("m", "groups", "n", "k"), [(3, 4, 24, 40), (129, 2, 136, 256), (7, 3, 64, 256)])
def test_fp8_grouped_linear_w8a8_matches_reference(interpret, m, groups, n, k) -> None:
    gen = torch.Generator().manual_seed(m + groups + n + k)
    w = torch.randn(groups * n, k, generator=gen)
    big = torch.randn(m, groups, k + 8, generator=gen)
    x = big[:, :, 3:3 + k]  # strided rows and groups
    q, s = quantize_fp8_block(w, (128, 128))
    out = torch.full((m, groups * n), float("nan"))
    scratch = torch.empty(fp8_w8a8_scratch_bytes(m, k, groups), dtype=torch.uint8)
    fp8_grouped_linear_w8a8(x, q, s, out, scratch)
    torch.testing.assert_close(out, fp8_grouped_linear_w8a8_ref(x, q, s), rtol=1e-4, atol=1e-4)


def test_w8a8_names_the_bad_argument(interpret) -> None:
    q, s = quantize_fp8_block(torch.randn(64, 256), (128, 128))
    x, out = torch.randn(4, 256), torch.empty(4, 64)
    with pytest.raises(KernelArgumentError, match="scratch"):
        fp8_linear_w8a8(x, q, s, out, torch.empty(10, dtype=torch.uint8))
    scratch = torch.empty(fp8_w8a8_scratch_bytes(4, 256), dtype=torch.uint8)
    with pytest.raises(KernelArgumentError, match="block"):
        fp8_linear_w8a8(x, q, s, out, scratch, block=(128, 64))
    with pytest.raises(KernelArgumentError, match="out"):
        fp8_linear_w8a8(x, q, s, torch.empty(4, 63), scratch)


def test_dequant_ref_is_the_inverse_within_e4m3_rounding() -> None:
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0))
    q, s = fp8_act_quant_ref(x)
    err = (fp8_act_dequant_ref(q, s) - x).abs()
    assert err.max() <= 2.0**-4 * x.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(129, 4096, 4096), (4096, 1024, 4096), (300, 520, 1000)])
def test_fp8_linear_w8a8_on_cuda(cuda, m, n, k) -> None:
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    q, s = quantize_fp8_block(w, (128, 128))
    q, s, xb = q.cuda(), s.cuda(), x.cuda().bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(fp8_w8a8_scratch_bytes(m, k), dtype=torch.uint8, device="cuda")
    fp8_linear_w8a8(xb, q, s, out, scratch)
    codes = scratch[: m * k].view(m, 1, k)
    assert torch.equal(codes.view(m, k), fp8_act_quant_ref(xb)[0].view(torch.uint8))
    ref = fp8_linear_w8a8_ref(xb.float(), q, s)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_only_wide_many_row_products_take_the_w8a8_form() -> None:
    from kernels.fp8_w8a8 import W8A8_MIN_N, W8A8_MIN_ROWS, uses_w8a8

    block = (128, 128)
    assert uses_w8a8(W8A8_MIN_ROWS, block, 32768) and uses_w8a8(4096, block, W8A8_MIN_N)
    assert not uses_w8a8(W8A8_MIN_ROWS - 1, block, 32768)  # decode rows: weight-only GEMV
    assert uses_w8a8(4096, block, 1024) and uses_w8a8(4096, block, 512)  # q_a, kv
    assert not uses_w8a8(4096, block, W8A8_MIN_N - 1)  # narrower than measured
    assert not uses_w8a8(4096, (128, 64), 4096)  # a K block unlike the activation group
    assert uses_w8a8(4096, block)  # no width given: rows and block only
