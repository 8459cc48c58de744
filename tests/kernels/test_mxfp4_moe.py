"""kernels.moe_experts (sort + grouped MXFP4 GEMMs + SwiGLU + combine) against
kernels.mxfp4_moe_ref: one token, experts with no tokens, a token choosing one expert twice
(hash routing), ties, hidden/intermediate multiples of 32 but not of 128, odd expert counts.
CPU tier through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes
from kernels.mxfp4_moe_ref import E2M1_VALUES, dequantize_mxfp4, moe_experts_ref, quantize_mxfp4


def pick_experts(t: int, k: int, e: int, ids: str | None, g: torch.Generator) -> torch.Tensor:
    """[t, k] expert ids: "skewed" sends every token to experts 1, 5 and 6 (the others get
    none), "repeat" lets a token pick one expert twice, None draws k distinct experts a token."""
    if ids == "skewed":
        return torch.tensor([[1, 5, 6]] * t)
    if ids == "repeat":
        picks = torch.randint(0, e, (t, k), generator=g)
        picks[0] = 3
        return picks
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])

def _experts(e: int, hid: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gu = quantize_mxfp4(torch.randn(e, 2 * inter, hid, generator=g) * 0.1)
    dn = quantize_mxfp4(torch.randn(e, hid, inter, generator=g) * 0.1)
    return (*gu, *dn)


def _routing(t: int, k: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts a token [t, k] and their routing weights [t, k]."""
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def _launch(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, weights: tuple, tiles,
            **kw) -> torch.Tensor:
    """``launch_moe`` at ``tiles`` with fresh scratch in x's dtype -> the output [T, H]."""
    from kernels._mxfp4_moe_triton import launch_moe

    (t, hid), k, e, inter = x.shape, ids.shape[1], weights[0].shape[0], weights[2].shape[-1] * 2
    m, out = t * k, torch.empty(t, hid, dtype=x.dtype)
    launch_moe(x, ids.view(-1), torch.empty(m, dtype=torch.int64), torch.empty(e, dtype=torch.int32),
               w.view(-1), *weights, 7.0, torch.empty(m, inter, dtype=x.dtype),
               torch.empty(m, hid, dtype=x.dtype), out, k, False, tiles, **kw)
    return out


def _cuda_step(t: int, k: int, e: int, hid: int, inter: int, seed: int):
    """A random step on the GPU: MXFP4 codes with scales near 1 (at V4-Flash's widths quantizing
    is slow) as [gate-up, its scales, down, its scales], bf16 tokens [t, hid], expert ids and
    routing weights [t, k], and a bf16 output buffer."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    u8 = dict(device="cuda", generator=g, dtype=torch.uint8)
    weights = [torch.randint(0, 256, (e, 2 * inter, hid // 2), **u8),
               torch.randint(118, 122, (e, 2 * inter, hid // 32), **u8),
               torch.randint(0, 256, (e, hid, inter // 2), **u8),
               torch.randint(118, 122, (e, hid, inter // 32), **u8)]
    x = torch.randn(t, hid, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), device="cuda", generator=g)
    w = torch.rand(t, k, device="cuda", generator=g)
    return weights, x, ids, w, torch.empty(t, hid, device="cuda", dtype=torch.bfloat16), g


def test_quantize_round_trip_and_every_code() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(1, 8).repeat(1, 2)  # 32 values, one group
    w = dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert w[0].tolist() == list(E2M1_VALUES) * 2
    x = torch.randn(6, 64)
    q, s = quantize_mxfp4(x)
    again = quantize_mxfp4(dequantize_mxfp4(q, s))
    assert torch.equal(dequantize_mxfp4(*again), dequantize_mxfp4(q, s))  # exact values round-trip
    assert (dequantize_mxfp4(q, s) - x).abs().max() <= x.abs().max() / 4


@pytest.mark.parametrize(("t", "k", "e", "hid", "inter", "ids"), [
    (1, 2, 5, 160, 96, None),                        # one token (decode)
    (9, 3, 7, 96, 32, "skewed"),                     # most experts get no token
    (6, 2, 4, 64, 64, "repeat"),                     # a token picks one expert twice
    (40, 6, 16, 32, 160, None),                      # many rows per expert, I not a 128 multiple
    (173, 6, 11, 32, 32, "repeat"),                  # 1,038 pairs: the tiled sort
])
def test_moe_experts_matches_reference(interpret, t, k, e, hid, inter, ids) -> None:
    g = torch.Generator().manual_seed(t * 31 + e)
    weights = _experts(e, hid, inter, t + e)
    x = torch.randn(t, hid, generator=g)
    topk_ids = pick_experts(t, k, e, ids, g)
    topk_w = torch.rand(t, k, generator=g)
    shared = torch.randn(t, hid, generator=g)
    out = shared.clone()
    ws = torch.empty(moe_experts_workspace_bytes(t, k, hid, inter, e, x.dtype), dtype=torch.uint8)
    moe_experts(x, topk_w, topk_ids, *weights, 7.0, out, accumulate=True, workspace=ws)
    want = shared + moe_experts_ref(x, topk_w, topk_ids, *weights, 7.0)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_swiglu_limit_clamps(interpret) -> None:
    """Large activations: the clamp must act (limit 0.5 changes the answer)."""
    weights = _experts(3, 64, 32, 0)
    x = 20 * torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    ids, w = torch.tensor([[0, 2]] * 4), torch.ones(4, 2)
    out = torch.empty(4, 64)
    moe_experts(x, w, ids, *weights, 0.5, out)
    torch.testing.assert_close(out, moe_experts_ref(x, w, ids, *weights, 0.5), rtol=1e-4, atol=1e-4)
    assert (out - moe_experts_ref(x, w, ids, *weights, 100.0)).abs().max() > 1e-2


def test_bf16_activations(interpret) -> None:
    weights = _experts(4, 96, 64, 2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    out = torch.empty(5, 96, dtype=torch.bfloat16)
    moe_experts(x, w, ids, *weights, 7.0, out)
    ref = moe_experts_ref(x.float(), w, ids, *weights, 7.0)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2


def test_moe_experts_names_the_bad_argument(interpret) -> None:
    weights = _experts(2, 64, 32, 0)
    x, w, ids = torch.zeros(3, 64), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(KernelArgumentError, match="'topk_ids'"):
        moe_experts(x, w, ids.int(), *weights, 7.0, torch.zeros(3, 64))
    with pytest.raises(KernelArgumentError, match="'down_scale'"):
        moe_experts(x, w, ids, *weights[:3], weights[3][:, :, :0], 7.0, torch.zeros(3, 64))
    with pytest.raises(KernelArgumentError, match="'workspace'"):
        moe_experts(x, w, ids, *weights, 7.0, torch.zeros(3, 64), workspace=torch.empty(8, dtype=torch.uint8))


@pytest.mark.gpu
def test_moe_experts_on_cuda_without_host_sync(cuda) -> None:
    t, k, e, hid, inter = 300, 6, 128, 4096, 2048
    weights, x, ids, w, out, g = _cuda_step(t, k, e, hid, inter, seed=0)
    ws = torch.empty(moe_experts_workspace_bytes(t, k, hid, inter, e), dtype=torch.uint8, device="cuda")
    moe_experts(x, w, ids, *weights, 7.0, out, workspace=ws)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts(x, w, ids, *weights, 7.0, out, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = moe_experts_ref(x.float(), w, ids, *weights, 7.0)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("tiles", [(16, 64, 128, 4, 3), (128, 128, 64, 8, 3),
                                   (64, 128, 64, 8, 3, 1), (16, 32, 64, 4, 3, 0),
                                   (1, 16, 256, 4, 3, 1), (1, 16, 128, 4, 3, 0),
                                   (1, 32, 64, 4, 1, 1), (64, 128, 64, 8, 3, 1, 0, 1),
                                   (16, 32, 64, 4, 3, 0, 0, 1), (64, 128, 64, 8, 3, 1, 0, 1, 1),
                                   (16, 32, 64, 4, 3, 0, 0, 0, 1), (64, 128, 64, 8, 3, 0, 0, 1, 1)])
def test_gpu_tiles_on_awkward_shapes(interpret, tiles) -> None:
    """The decode (swapped operands) and prefill tiles the GPU launches, and prefill-sized tiles
    with the operands swapped (a 6th element), through the interpreter: hidden 160 and
    intermediate 96 leave partial K- and N-tiles everywhere. ``BLOCK_M`` 1 is the per-pair GEMV,
    its 6th element the int32-word decode (1) or the per-byte one (0); a tiled form's 8th element
    decodes int32 words straight to bf16, its 9th runs the programs N-tiles first."""
    t, k, e, hid, inter = 7, 3, 5, 160, 96
    g = torch.Generator().manual_seed(11)
    weights = _experts(e, hid, inter, 5)
    x = torch.randn(t, hid, generator=g)
    ids, w = _routing(t, k, e, g)
    out = _launch(x, ids, w, weights, tiles)
    torch.testing.assert_close(out, moe_experts_ref(x, w, ids, *weights, 7.0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [(16, 32, 64, 4, 1, 1, 1), (64, 32, 64, 4, 1, 0, 1),
                                   (64, 64, 128, 4, 1, 1, 1)])
def test_scaled_dot_tiles(interpret, tiles) -> None:
    """The ``tl.dot_scaled`` form (7th tile element) on bf16 activations, swapped and not, with
    partial K- and N-tiles (hidden 160, intermediate 96): same answer as the reference."""
    t, k, e, hid, inter = 9, 3, 5, 160, 96
    g = torch.Generator().manual_seed(13)
    weights = _experts(e, hid, inter, 6)
    x = torch.randn(t, hid, generator=g).bfloat16()
    ids, w = _routing(t, k, e, g)
    out = _launch(x, ids, w, weights, tiles)
    ref = moe_experts_ref(x.float(), w, ids, *weights, 7.0)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(128, 128, 128, 8, 3, 1), (128, 128, 64, 8, 3, 0),
                                   (16, 64, 128, 4, 3, 1), (256, 64, 128, 8, 3, 1),
                                   (128, 128, 128, 8, 3, 0)])
def test_tiled_word_decode_on_cuda(cuda, tiles) -> None:
    """On the GPU the word decode runs in bf16 (the interpreter cannot): the same bits as the
    byte decode at the prefill and decode tiles, with scales from 2**-120 to 2**8 and every
    code, at V4-Flash's expert widths (a prefill-sized step of 1,500 tokens x top-6); and the
    same bits again with the programs N-tiles first."""
    from kernels._mxfp4_moe_triton import launch_moe

    t, k, e, hid, inter = 1500, 6, 16, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(3)
    u8 = dict(device="cuda", generator=g, dtype=torch.uint8)
    gu, dn = (torch.randint(0, 256, (e, 2 * inter, hid // 2), **u8),
              torch.randint(0, 256, (e, hid, inter // 2), **u8))
    gus, dns = (torch.randint(7, 136, (e, 2 * inter, hid // 32), **u8),
                torch.randint(7, 136, (e, hid, inter // 32), **u8))
    x = (torch.randn(t, hid, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    ids = torch.randint(0, e, (t * k,), device="cuda", generator=g)
    w = torch.rand(t * k, device="cuda", generator=g)
    outs = []
    for rest in ((0, 0), (0, 1), (0, 1, 1)):
        m = t * k
        out = torch.empty(t, hid, device="cuda", dtype=torch.bfloat16)
        launch_moe(x, ids, torch.empty(m, dtype=torch.int64, device="cuda"),
                   torch.empty(e, dtype=torch.int32, device="cuda"), w, gu, gus, dn, dns, 7.0,
                   torch.empty(m, inter, device="cuda", dtype=torch.bfloat16),
                   torch.empty(m, hid, device="cuda", dtype=torch.bfloat16), out, k, False,
                   (*tiles, *rest))
        outs.append(out)
    assert bool(outs[0].isfinite().all())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("tiles", [(16, 32, 64, 4, 1, 1, 0, 1), (64, 32, 64, 4, 1, 0, 0, 1)])
def test_tiled_word_decode_is_the_byte_decode(interpret, tiles) -> None:
    """The tiled forms' word decode (straight to bf16, scaled in bf16) gives the byte decode's
    answer bit for bit on bf16 activations, with scales across e8m0's range: 2**-120 to 2**8
    (the bf16 product 2**(s - 1) alone would overflow from s = 129), partial K- and N-tiles."""
    t, k, e, hid, inter = 9, 3, 5, 160, 96
    g = torch.Generator().manual_seed(17)
    gu, gus, dn, dns = _experts(e, hid, inter, 21)
    gus = torch.randint(7, 136, gus.shape, generator=g).to(torch.uint8)
    dns = torch.randint(7, 136, dns.shape, generator=g).to(torch.uint8)
    x = (torch.randn(t, hid, generator=g) * 1e-3).bfloat16()
    ids, w = _routing(t, k, e, g)
    outs = [_launch(x, ids, w, (gu, gus, dn, dns), (*tiles[:-1], words)) for words in (0, 1)]
    assert outs[0].isfinite().all() and outs[0].abs().max() > 0
    assert torch.equal(outs[0], outs[1])


def test_down_gemm_takes_its_own_tiles(interpret) -> None:
    """Gate-up and down at different tiles (one swapped, one not; different row tiles)."""
    t, k, e, hid, inter = 11, 2, 4, 96, 64
    g = torch.Generator().manual_seed(5)
    weights = _experts(e, hid, inter, 9)
    x = torch.randn(t, hid, generator=g)
    ids, w = _routing(t, k, e, g)
    out = _launch(x, ids, w, weights, (16, 32, 64, 4, 1, 1), down_tiles=(64, 64, 32, 4, 1, 0))
    torch.testing.assert_close(out, moe_experts_ref(x, w, ids, *weights, 7.0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("tiles", "splits"), [
    *((tiles, splits) for tiles in (None, (16, 64, 128, 4, 3))
      for splits in ((2, 1), (1, 2), (3, 2), (8, 8))),
    ((1, 32, 64, 4, 1), (3, 2)),  # BLOCK_M 1: the per-pair GEMV form, both GEMMs split
])
@pytest.mark.parametrize(("t", "k", "e", "hid", "inter", "ids"), [
    (1, 2, 5, 160, 96, None),       # one token; K-tiles 64: hidden 160 ends inside a slice
    (3, 3, 7, 160, 96, "skewed"),   # experts 0, 2, 3, 4 get no row
    (17, 2, 6, 96, 160, "repeat"),  # a token picks one expert twice; intermediate 160
])
def test_moe_split_k_matches_reference(interpret, tiles, splits, t, k, e, hid, inter,
                                       ids) -> None:
    """Split-K of the decode form (gate-up over hidden, down over intermediate), through a
    workspace sized by the helper and left dirty (NaN bytes) from a previous step: every
    partial the epilogue and the combine read must have been written this step. The GPU's
    128-wide K-tiles leave 96 columns one tile: a split asked for that cannot happen."""
    g = torch.Generator().manual_seed(t * 13 + e + splits[0])
    weights = _experts(e, hid, inter, t + e)
    x = torch.randn(t, hid, generator=g)
    topk_ids = pick_experts(t, k, e, ids, g)
    topk_w = torch.rand(t, k, generator=g)
    need = moe_experts_workspace_bytes(t, k, hid, inter, e, x.dtype, splits=splits)
    assert need > moe_experts_workspace_bytes(t, k, hid, inter, e, x.dtype, splits=(1, 1))
    ws = torch.full((need,), 0xFF, dtype=torch.uint8)
    ref = moe_experts_ref(x, topk_w, topk_ids, *weights, 7.0)
    for _ in range(2 if t < 8 else 1):  # a second (dirty-scratch) step where it is cheap
        out = torch.zeros(t, hid)
        moe_experts(x, topk_w, topk_ids, *weights, 7.0, out, workspace=ws, splits=splits,
                    tiles=tiles)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [(2, 2), (4, 1)])
def test_moe_split_k_at_gpu_decode_tiles(interpret, splits) -> None:
    """The GPU's decode tiles (BLOCK_K 128) with split-K: hidden 160 leaves a 32-wide last
    slice, intermediate 96 one slice only (a split asked for but not possible)."""
    from kernels._mxfp4_moe_triton import split_k_slices

    t, k, e, hid, inter = 5, 3, 5, 160, 96
    assert split_k_slices(hid, 128, splits[0]) == (2, 1)
    assert split_k_slices(inter, 128, splits[1]) == (1, 1)
    g = torch.Generator().manual_seed(17)
    weights = _experts(e, hid, inter, 5)
    x = torch.randn(t, hid, generator=g)
    ids, w = _routing(t, k, e, g)
    out = _launch(x, ids, w, weights, (16, 64, 128, 4, 3), splits=splits,
                  gu_part=torch.full((splits[0], t * k, 2 * inter), float("nan")))
    torch.testing.assert_close(out, moe_experts_ref(x, w, ids, *weights, 7.0), rtol=1e-4, atol=1e-4)


def test_moe_max_workspace_covers_every_step() -> None:
    from kernels.mxfp4_moe import moe_experts_max_workspace_bytes

    bound = moe_experts_max_workspace_bytes(50, 6, 64, 32, 8)
    assert bound >= max(moe_experts_workspace_bytes(t, 6, 64, 32, 8) for t in range(1, 51))


@pytest.mark.gpu
def test_split_k_variants_replay_from_a_cuda_graph(cuda) -> None:
    """The split-K decode forms captured once and replayed with new inputs and routing: every
    partial is rewritten each replay (nothing relies on zeroed scratch), for the experts and
    for the FP8 GEMV."""
    from kernels.fp8_linear import Fp8GemvVariant, fp8_linear, fp8_linear_scratch_bytes
    from kernels.fp8_linear_ref import fp8_linear_ref

    t, k, e, hid, inter = 8, 6, 32, 4096, 2048
    weights, x, ids, w, out, g = _cuda_step(t, k, e, hid, inter, seed=1)
    ws = torch.empty(moe_experts_workspace_bytes(t, k, hid, inter, e, splits=(4, 4)),
                     dtype=torch.uint8, device="cuda")
    q = (torch.randn(4096, 4096, device="cuda", generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(32, 32, device="cuda", generator=g) * 1e-2
    xl = torch.randn(3, 4096, device="cuda", generator=g).to(torch.bfloat16)
    yl = [torch.empty(3, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    variants = [Fp8GemvVariant((16, 32, 128, 2, 4, 3), 4), Fp8GemvVariant((1, 8, 128, 2, 2, 3), 8, "sum")]
    ws_l = [torch.empty(fp8_linear_scratch_bytes(3, 4096, 4096, variant=v), dtype=torch.uint8,
                        device="cuda") for v in variants]

    def step() -> None:
        moe_experts(x, w, ids, *weights, 7.0, out, workspace=ws, splits=(4, 4))
        for v, wl, y in zip(variants, ws_l, yl, strict=True):
            fp8_linear(xl, q, s, y, workspace=wl, gemv=v)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    for _ in range(2):
        x.copy_(torch.randn(t, hid, device="cuda", generator=g))
        ids.copy_(torch.randint(0, e, (t, k), device="cuda", generator=g))
        xl.copy_(torch.randn(3, 4096, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_experts_ref(x.float(), w, ids, *weights, 7.0)
        assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
        ref_l = fp8_linear_ref(xl.float(), q, s)
        for y in yl:
            assert float((y.float() - ref_l).norm() / ref_l.norm()) < 1e-2


def test_experts_module_takes_prefill_tiles_only_at_prefill_sizes(interpret, monkeypatch) -> None:
    """``Mxfp4Experts.prefill_tiles`` (benchmarks sweep it in the full model) reaches the kernels
    only for a step of more than ``PREFILL_MIN_PAIRS`` pairs; a decode step keeps the kernel's
    choice. Both give the reference's answer."""
    import kernels._mxfp4_moe_triton as moe
    from engine.models.deepseek_v4.weights.quant_modules import Mxfp4Experts
    from kernels.moe_sort_sizes import PREFILL_MIN_PAIRS

    e, hid, inter, k = 4, 64, 32, 3
    mod = Mxfp4Experts(e, hid, inter)
    gu, gus, dn, dns = _experts(e, hid, inter, 31)
    mod.gate_up_proj.copy_(gu)
    mod.gate_up_proj_scale.copy_(gus)
    mod.down_proj.copy_(dn)
    mod.down_proj_scale.copy_(dns)
    mod.use_kernels = True
    mod.prefill_tiles = (16, 32, 64, 4, 1, 0, 0, 1, 1)
    seen: list[object] = []
    launch = moe.launch_moe
    monkeypatch.setattr(moe, "launch_moe", lambda *a, **kw: (seen.append(kw.get("tiles")),
                                                             launch(*a, **kw))[1])
    g = torch.Generator().manual_seed(2)
    for t in (5, PREFILL_MIN_PAIRS // k + 1):
        x = torch.randn(t, hid, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        out = mod.add_into(x, w, ids, torch.zeros(t, hid), 7.0, None)
        torch.testing.assert_close(out, moe_experts_ref(x, w, ids, gu, gus, dn, dns, 7.0),
                                   rtol=1e-4, atol=1e-4)
    assert seen == [None, mod.prefill_tiles]
