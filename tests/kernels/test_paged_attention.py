"""paged_attention / paged_decode_attention (Triton, interpreted on CPU) against the references."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    KernelArgumentError,
    PagedTiles,
    paged_attention,
    paged_attention_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_workspace_bytes,
)
from kernels.kv_quant import KV_FP8_DTYPE, quantize_kv

SMALL = PagedTiles(block_m=16, block_n=16, decode_block_n=16)


def _cache(num_blocks, block_size, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    return k, v, g


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return quantize_kv(x, KV_FP8_DTYPE)


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block_size", "dtype"),
    [(6, 2, 24, 4, torch.float32), (5, 1, 40, 3, torch.bfloat16), (4, 4, 16, 16, torch.float32)],
)
def test_prefill_and_mixed_match_reference(interpret, hq, hkv, d, block_size, dtype,
                                           kv_fp8) -> None:
    """kv_fp8 (kv_dtype=fp8): the kernel reads e4m3fn K/V (scale 1) and must agree with the
    reference on the same stored values to the precision of q's dtype (the upcast is exact)."""
    k, v, g = _cache(40, block_size, hkv, d, torch.float32 if kv_fp8 else dtype,
                     seed=hq * d + kv_fp8)
    if kv_fp8:
        k, v = _fp8(3 * k), _fp8(v)
    q_lens = [5, 0, 1, 19, 3]  # a chunk, an idle sequence, a decode, a fresh prefill, a tail
    ctx = [5, 7, 17, 19, 30]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    max_blocks = -(-max(ctx) // block_size)
    tables = torch.stack([torch.randperm(39, generator=g)[:max_blocks] + 1 for _ in ctx])
    tables = tables.to(torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    paged_attention(q, k, v, tables, qsl, ctx_t, d**-0.5, out, tiles=SMALL)
    ref = paged_attention_ref(q, k, v, tables, qsl, ctx_t, d**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("hq", "hkv", "d", "block_size", "kv_fp8"),
                         [(8, 2, 32, 4, False), (6, 2, 20, 5, True)])
def test_decode_matches_reference(interpret, num_splits, hq, hkv, d, block_size, kv_fp8) -> None:
    k, v, g = _cache(30, block_size, hkv, d, torch.float32,
                     seed=7 * kv_fp8 + num_splits)
    if kv_fp8:
        k, v = _fp8(k), _fp8(v)
    ctx = torch.tensor([1, 23, 9, 28], dtype=torch.int32)
    max_blocks = -(-int(ctx.max()) // block_size)
    tables = torch.stack([torch.randperm(29, generator=g)[:max_blocks] + 1
                          for _ in range(4)]).int()
    q = torch.randn(4, hq, d, generator=g)
    out = torch.full_like(q, float("nan"))
    ws = torch.empty(max(paged_decode_workspace_bytes(4, hq, d, num_splits), 1), dtype=torch.uint8)
    paged_decode_attention(q, k, v, tables, ctx, d**-0.5, out, num_splits=num_splits,
                           workspace=ws, tiles=SMALL)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_fp8_reference_stays_near_the_unquantized_one() -> None:
    """What kv_dtype=fp8 costs at the attention output, unit-variance K/V (scale 1): within
    0.05 absolute of the full-precision answer (measured: 0.030, outputs up to 0.71)."""
    hq, hkv, d, block_size = 8, 2, 64, 16
    k, v, g = _cache(12, block_size, hkv, d, torch.float32, seed=3)
    ctx = torch.tensor([150, 37], dtype=torch.int32)
    tables = torch.stack([torch.randperm(11, generator=g)[:10] + 1 for _ in range(2)]).int()
    q = torch.randn(2, hq, d, generator=g)
    exact = paged_decode_attention_ref(q, k, v, tables, ctx, d**-0.5)
    fp8 = paged_decode_attention_ref(q, _fp8(k), _fp8(v), tables, ctx, d**-0.5)
    assert (fp8 - exact).abs().max() < 0.05


def test_rejects_bad_arguments(interpret) -> None:
    k, v, _ = _cache(4, 4, 3, 16, torch.float32, seed=0)
    q = torch.randn(2, 4, 16)
    tables = torch.ones(2, 1, dtype=torch.int32)
    ctx = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(KernelArgumentError, match="KV heads"):
        paged_decode_attention(q, k, v, tables, ctx, 1.0, torch.empty_like(q))
    with pytest.raises(KernelArgumentError, match="workspace"):
        q6 = torch.randn(2, 6, 16)
        paged_decode_attention(q6, k, v, tables, ctx, 1.0, torch.empty_like(q6), num_splits=2,
                               workspace=torch.empty(4, dtype=torch.uint8))
    with pytest.raises(KernelArgumentError, match="v_cache"):  # K and V stored alike
        paged_decode_attention(q, k, _fp8(v), tables, ctx, 1.0, torch.empty_like(q))
    with pytest.raises(KernelArgumentError, match="query_start_loc"):
        q6 = torch.randn(2, 6, 16)
        paged_attention(q6, k, v, tables, torch.tensor([0, 2]), ctx, 1.0, torch.empty_like(q6))
