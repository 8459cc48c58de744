"""kernels.fp8_linear against kernels.fp8_linear_ref: awkward N and K (not multiples of the
128 block, partial last scale block), one row, scale blocks narrower than a K-tile, every e4m3
bit pattern. CPU tier through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.fp8_linear import fp8_linear
from kernels.fp8_linear_ref import dequantize_fp8_block, fp8_linear_ref


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (e4m3 [N, K], fp32 scale [ceil(N/bn), ceil(K/bk)]) by per-block amax."""
    n, k = w.shape
    gn, gk = -(-n // block[0]), -(-k // block[1])
    pad = torch.zeros(gn * block[0], gk * block[1])
    pad[:n, :k] = w
    blocks = pad.view(gn, block[0], gk, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[:, None, :, None]).view_as(pad)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.float()


@pytest.mark.parametrize(("m", "n", "k", "block"), [
    (1, 200, 160, (128, 128)),   # one token, N and K not multiples of 128
    (5, 72, 40, (128, 128)),     # everything inside one partial block
    (37, 130, 257, (128, 128)),  # a 1-wide last block row, K odd
    (20, 48, 40, (16, 8)),       # scale blocks narrower than a K-tile
])
def test_fp8_linear_matches_reference(interpret, m, n, k, block) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, s = quantize_fp8_block(w, block)
    out = torch.full((m, n), float("nan"))
    fp8_linear(x, q, s, out, block)
    torch.testing.assert_close(out, fp8_linear_ref(x, q, s, block), rtol=1e-4, atol=1e-4)
    assert (dequantize_fp8_block(q, s, block) - w).abs().max() < 0.07 * w.abs().max()


def test_every_e4m3_pattern_decodes(interpret) -> None:
    bits = torch.arange(256, dtype=torch.uint8)
    bits = bits[~bits.view(torch.float8_e4m3fn).float().isnan()]  # 0x7f / 0xff are NaN
    w = bits.view(-1, 1)  # [254, 1]: y = x * value
    out = torch.empty(1, bits.numel())
    fp8_linear(torch.ones(1, 1), w, torch.ones(2, 1), out)
    torch.testing.assert_close(out[0], bits.view(torch.float8_e4m3fn).float(), rtol=0, atol=0)


def test_strided_rows_and_bf16(interpret) -> None:
    g = torch.Generator().manual_seed(3)
    q, s = quantize_fp8_block(torch.randn(96, 136, generator=g), (128, 128))
    big = torch.randn(7, 300, generator=g).to(torch.bfloat16)
    x = big[:, 10:146]  # row stride 300
    out = torch.empty(7, 96, dtype=torch.bfloat16)
    fp8_linear(x, q, s, out)
    torch.testing.assert_close(out, fp8_linear_ref(x, q, s), rtol=2e-2, atol=2e-2)


def test_fp8_linear_names_the_bad_argument(interpret) -> None:
    q, s = quantize_fp8_block(torch.randn(8, 16), (128, 128))
    with pytest.raises(KernelArgumentError, match="'weight'"):
        fp8_linear(torch.zeros(2, 12), q, s, torch.zeros(2, 8))
    with pytest.raises(KernelArgumentError, match="'scale'"):
        fp8_linear(torch.zeros(2, 16), q, torch.ones(2, 2), torch.zeros(2, 8))
    with pytest.raises(KernelArgumentError, match="'out'"):
        fp8_linear(torch.zeros(2, 16), q, s, torch.zeros(3, 8))


@pytest.mark.gpu
def test_fp8_linear_on_cuda(cuda) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    # (1, 2048, 640): the unsplit GEMV, two K-tiles a trip over 5 whole K-tiles (the second
    # tile of the last trip masked by the tile predicate of EVEN_K)
    for m, n, k in ((1, 4096, 4096), (1, 2048, 640), (33, 1024, 4000), (512, 2048, 4096)):
        q, s = quantize_fp8_block(torch.randn(n, k, device="cpu"), (128, 128))
        q, s = q.cuda(), s.cuda()
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fp8_linear(x, q, s, out)
        ref = fp8_linear_ref(x.float(), q, s)
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize(("m", "groups", "n", "k"), [(3, 4, 24, 40), (1, 2, 136, 160)])
def test_fp8_grouped_linear_matches_reference(interpret, m, groups, n, k) -> None:
    """Group boundaries that cut through a 128-row scale block (24 rows a group)."""
    from kernels.fp8_linear import fp8_grouped_linear
    from kernels.fp8_linear_ref import fp8_grouped_linear_ref

    g = torch.Generator().manual_seed(m + n)
    q, s = quantize_fp8_block(torch.randn(groups * n, k, generator=g), (128, 128))
    x = torch.randn(m, groups * k, generator=g).view(m, groups, k)
    out = torch.full((m, groups * n), float("nan"))
    fp8_grouped_linear(x, q, s, out)
    torch.testing.assert_close(out, fp8_grouped_linear_ref(x, q, s), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 70, 300), (32, 200, 300), (40, 33, 260)])
def test_fp8_linear_keeps_nan_codes_nan(interpret, m, n, k) -> None:
    """e4m3 0x7F / 0xFF are NaN in the reference; the kernel's outputs are NaN exactly where
    the reference's are (decode kernel at m <= 32, tiled kernel above)."""
    g = torch.Generator().manual_seed(n)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g), (128, 128))
    u8 = q.view(torch.uint8).clone()
    u8[3, 5], u8[n - 1, k - 1] = 0x7F, 0xFF
    q = u8.view(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=g)
    out = torch.empty(m, n)
    fp8_linear(x, q, s, out)
    ref = fp8_linear_ref(x, q, s)
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().any()
    torch.testing.assert_close(out.nan_to_num(0.0), ref.nan_to_num(0.0), rtol=1e-4, atol=1e-4)


def test_fp8_decode_tiles_cover_partial_unrolled_k(interpret) -> None:
    """m in (16, 32]: the 32-row decode tile; K = 300 ends inside the second K-tile of an
    unrolled trip; N = 200 leaves a partial N tile."""
    from kernels.fp8_linear import fp8_gemv_tiles

    assert fp8_gemv_tiles(20, 200, 128) == (32, 32, 128, 2, 4, 3)
    g = torch.Generator().manual_seed(5)
    q, s = quantize_fp8_block(torch.randn(200, 300, generator=g), (128, 128))
    x = torch.randn(20, 300, generator=g)
    out = torch.empty(20, 200)
    fp8_linear(x, q, s, out)
    torch.testing.assert_close(out, fp8_linear_ref(x, q, s), rtol=1e-4, atol=1e-4)


_GEMV_VARIANTS = [
    ((16, 32, 128, 2, 4, 3), 1, "dot"),   # unsplit, two K-tiles a trip (the small-N default)
    ((16, 32, 128, 2, 4, 3), 2, "dot"),   # two slices, the second partial (K 300 -> 256 | 44)
    ((32, 16, 64, 1, 4, 3), 3, "dot"),    # 32-row tile, three slices of 64-wide K-tiles
    ((16, 32, 32, 2, 4, 3), 8, "dot"),    # more slices asked for than whole trips: fewer run
    ((1, 4, 128, 1, 1, 3), 1, "sum"),     # the no-dot form, 4 rows a program
    ((1, 16, 64, 2, 2, 3), 3, "sum"),     # no-dot form with split-K
]


@pytest.mark.parametrize(("tiles", "split", "form"), _GEMV_VARIANTS)
@pytest.mark.parametrize(("m", "n", "k"),
                         [(1, 200, 300), (3, 70, 520), (17, 33, 260), (2, 72, 384)])
def test_fp8_gemv_variants_match_reference(interpret, tiles, split, form, m, n, k) -> None:
    """Every decode variant (split-K, the no-dot form) on N not a multiple of BLOCK_N and K
    ending inside the last slice, through a caller workspace sized by the helper; a stale
    workspace (NaN) must not leak into the result. K = 384 is whole K-tiles (the unmasked
    form), with a slice of 1 K-tile where two are unrolled."""
    from kernels.fp8_linear import Fp8GemvVariant, fp8_linear_scratch_bytes

    variant = Fp8GemvVariant(tiles, split, form)
    g = torch.Generator().manual_seed(m * 7 + n + split)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g), (128, 128))
    x = torch.randn(m, k, generator=g)
    need = fp8_linear_scratch_bytes(m, n, k, (128, 128), variant)
    assert (need > 0) == (split > 1)
    ws = torch.full((need + 256,), 0xFF, dtype=torch.uint8)  # 0xFFFFFFFF is a NaN in fp32
    out = torch.full((m, n), float("nan"))
    for _ in range(2):  # a replayed step reuses the dirty scratch
        fp8_linear(x, q, s, out, workspace=ws, gemv=variant)
        torch.testing.assert_close(out, fp8_linear_ref(x, q, s), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("tiles", "split", "form"), _GEMV_VARIANTS[1::2])
def test_fp8_grouped_gemv_variants(interpret, tiles, split, form) -> None:
    """Group boundaries inside a scale block, with split-K partials laid out over all groups."""
    from kernels.fp8_linear import Fp8GemvVariant, fp8_grouped_linear
    from kernels.fp8_linear_ref import fp8_grouped_linear_ref

    m, groups, n, k = 3, 4, 24, 200
    g = torch.Generator().manual_seed(9)
    q, s = quantize_fp8_block(torch.randn(groups * n, k, generator=g), (128, 128))
    x = torch.randn(m, groups * k, generator=g).view(m, groups, k)
    out = torch.full((m, groups * n), float("nan"))
    fp8_grouped_linear(x, q, s, out, gemv=Fp8GemvVariant(tiles, split, form))
    torch.testing.assert_close(out, fp8_grouped_linear_ref(x, q, s), rtol=1e-4, atol=1e-4)


def test_fp8_gemv_sum_form_keeps_nan_codes_nan(interpret) -> None:
    from kernels.fp8_linear import Fp8GemvVariant

    g = torch.Generator().manual_seed(4)
    q, s = quantize_fp8_block(torch.randn(40, 300, generator=g), (128, 128))
    u8 = q.view(torch.uint8).clone()
    u8[3, 5], u8[39, 299] = 0x7F, 0xFF
    q = u8.view(torch.float8_e4m3fn)
    x = torch.randn(2, 300, generator=g)
    out = torch.empty(2, 40)
    fp8_linear(x, q, s, out, gemv=Fp8GemvVariant((1, 8, 128, 1, 1, 3), 2, "sum"))
    ref = fp8_linear_ref(x, q, s)
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().any()


def test_fp8_gemv_variant_rejects_small_workspace(interpret) -> None:
    from kernels.fp8_linear import Fp8GemvVariant, fp8_linear_scratch_bytes

    variant = Fp8GemvVariant((16, 32, 128, 1, 4, 3), 2)
    q, s = quantize_fp8_block(torch.randn(8, 256), (128, 128))
    need = fp8_linear_scratch_bytes(1, 8, 256, (128, 128), variant)
    assert need == 2 * 1 * 8 * 4
    with pytest.raises(KernelArgumentError, match="'workspace'"):
        fp8_linear(torch.zeros(1, 256), q, s, torch.zeros(1, 8), gemv=variant,
                   workspace=torch.empty(need - 4, dtype=torch.uint8))


@pytest.mark.parametrize(("m", "n", "k", "split"), [
    (1, 4096, 4096, 8),    # V4-Flash's square projections: 64 N-tiles, K cut into 8
    (32, 8192, 4096, 4),   # grouped o_a, all groups: 128 N-tiles x 4 = 512 programs
    (1, 1024, 4096, 8),    # narrow N: as many slices as 4-tile slices allow
    (8, 32768, 1024, 1),   # q_b: 512 N-tiles already, short K: unsplit
    (1, 200, 512, 1),      # 4 K-tiles: a slice would hold fewer than 4
    (33, 4096, 4096, None),  # more than 32 rows: the tiled prefill kernel
])
def test_default_gemv_variant_splits_long_k_of_narrow_grids(m, n, k, split) -> None:
    from kernels.fp8_linear import fp8_gemv_variant, fp8_linear_scratch_bytes

    v = fp8_gemv_variant(m, n, k, 128)
    if split is None:
        assert v is None
        return
    assert v is not None and v.split == split and v.form == "dot"
    # the scratch the planner counts follows the choice: one fp32 partial a slice
    assert fp8_linear_scratch_bytes(m, n, k) == (0 if split == 1 else split * m * n * 4)


@pytest.mark.parametrize(("tiles", "split", "form"), [v for v in _GEMV_VARIANTS if v[1] > 1])
@pytest.mark.parametrize("groups", [1, 3])
def test_split_gemv_sums_its_own_partials(interpret, tiles, split, form, groups) -> None:
    """With the model's counters the last slice of each tile sums the partials in the same
    launch: the same bits as the two-launch reduce, no second launch, the counters left zero
    for the next launch (run twice over a dirty workspace, as a replayed graph does)."""
    import kernels._fp8_linear_triton as impl
    from kernels.fp8_linear import (
        Fp8GemvVariant,
        fp8_grouped_linear,
        fp8_linear_scratch_bytes,
        gemv_semaphores,
    )
    from kernels.fp8_linear_ref import fp8_grouped_linear_ref

    m, n, k = 3, 37, 300
    variant = Fp8GemvVariant(tiles, split, form)
    g = torch.Generator().manual_seed(split * 11 + groups)
    q, s = quantize_fp8_block(torch.randn(groups * n, k, generator=g), (128, 128))
    x = torch.randn(m, groups * k, generator=g).view(m, groups, k)
    ws = torch.full((fp8_linear_scratch_bytes(m, groups * n, k, (128, 128), variant),), 0xFF,
                    dtype=torch.uint8)
    two = torch.full((m, groups * n), float("nan"))
    fp8_grouped_linear(x, q, s, two, workspace=ws, gemv=variant)
    sem = gemv_semaphores("cpu")
    launched: list[str] = []
    real = impl._split_k_reduce_kernel
    with pytest.MonkeyPatch.context() as mp:
        class Spy:
            def __getitem__(self, grid):
                launched.append("reduce")
                return real[grid]
        mp.setattr(impl, "_split_k_reduce_kernel", Spy())
        for _ in range(2):
            one = torch.full((m, groups * n), float("nan"))
            ws.fill_(0xFF)
            fp8_grouped_linear(x, q, s, one, workspace=ws, gemv=variant, semaphores=sem)
            assert torch.equal(one, two)
            assert not sem.any(), "a counter was left set"
        assert not launched
        # too few counters for this launch's tiles: the second launch sums instead
        fp8_grouped_linear(x, q, s, one, workspace=ws, gemv=variant, semaphores=sem[:1])
        assert torch.equal(one, two) and launched == ["reduce"]
    torch.testing.assert_close(one, fp8_grouped_linear_ref(x, q, s), rtol=1e-4, atol=1e-4)
