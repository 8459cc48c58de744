"""kernels.fused against kernels.fused_ref on awkward shapes (odd widths, non-power-of-two head
dims, strided q/k/v views of one projection, scattered slots). CPU tier through the Triton
interpreter; the gpu tier runs the same checks compiled, in bf16."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.fused import add_rms_norm, rope_and_cache, silu_and_mul
from kernels.fused_ref import add_rms_norm_ref, rope_and_cache_ref, silu_and_mul_ref


def _tables(positions: int, d: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(positions).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _check_norm(n: int, c: int, dtype: torch.dtype, device: str, with_res: bool) -> None:
    g = torch.Generator().manual_seed(n * 1000 + c)
    x = torch.randn(n, c, generator=g).to(dtype).to(device)
    res = torch.randn(n, c, generator=g).to(dtype).to(device) if with_res else None
    w = (1 + 0.1 * torch.randn(c, generator=g)).to(dtype).to(device)
    want, want_res = add_rms_norm_ref(x, res, w, 1e-6)
    res_in = None if res is None else res.clone()
    out = torch.empty_like(x)
    add_rms_norm(x, res_in, w, 1e-6, out)
    if res_in is not None:
        assert torch.equal(res_in, want_res), "the residual must be x + residual exactly"
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, rtol=tol or 1e-6, atol=tol or 1e-6)


def _e4m3_midpoints() -> torch.Tensor:
    """Every value halfway between two neighbouring finite e4m3fn values, both signs (exact in
    fp32 and bf16): the round-half-even cases of the FP8 KV write."""
    finite = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (finite[:-1] + finite[1:]) / 2
    return torch.cat([mid, -mid])


def _check_rope(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str,
                kv_fp8: bool = False) -> None:
    g = torch.Generator().manual_seed(n + hq + d)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g)
    if kv_fp8 and device == "cpu":
        # k and v with magnitudes from 2^-12 to 2^10: subnormals, normals, values the write
        # clamps; v starts with every e4m3 rounding tie
        wide = qkv[:, hq * d :]
        wide *= torch.exp2(torch.rand(wide.shape, generator=g) * 22 - 12)
        v_flat = qkv[:, (hq + hkv) * d :].flatten().clone()
        mid = _e4m3_midpoints()[: v_flat.numel()]
        v_flat[: mid.numel()] = mid
        qkv[:, (hq + hkv) * d :] = v_flat.view(n, -1)
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    cos, sin = _tables(300, d, dtype, device)
    positions = torch.randint(0, 300, (n,), generator=g).to(device)
    num_blocks, bs = 7, 5
    slots = torch.randperm(num_blocks * bs, generator=g)[:n].to(device)
    cache_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    kc_want = torch.zeros(num_blocks, bs, hkv, d, dtype=cache_dtype, device=device)
    vc_want = torch.zeros_like(kc_want)
    q_want = rope_and_cache_ref(q, k, v, positions, cos, sin, slots, kc_want, vc_want)
    kc, vc = torch.zeros_like(kc_want), torch.zeros_like(vc_want)
    q_out = torch.empty(n, hq, d, dtype=dtype, device=device)
    rope_and_cache(q, k, v, positions.to(torch.int32), cos, sin, slots, kc, vc, q_out)

    def bits(t: torch.Tensor) -> torch.Tensor:  # FP8 compared byte for byte
        return t.view(torch.uint8) if kv_fp8 else t

    # v is copied, never rounded, or (FP8) clamped and rounded exactly as the reference
    assert torch.equal(bits(vc), bits(vc_want))
    if kv_fp8:  # the clamp: no NaN from values past +-448
        assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()
    if dtype == torch.float32:
        assert torch.equal(q_out, q_want)
        assert torch.equal(bits(kc), bits(kc_want))
    else:
        # Compiled for the GPU, ~20% of elements land one bf16 step from PyTorch's eager result
        # (H200, triton 3.6: the compiler keeps the products in fp32 across the casts; the
        # interpreter differs too), so the check is one bf16 step, not bit equality; after an
        # FP8 write, one e4m3 step.
        torch.testing.assert_close(q_out, q_want, rtol=8e-3, atol=8e-3)
        tol = (0.13, 2.0**-6) if kv_fp8 else (8e-3, 8e-3)
        torch.testing.assert_close(kc.float(), kc_want.float(), rtol=tol[0], atol=tol[1])


def _check_silu(n: int, i: int, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(n * 7 + i)
    gate_up = (3 * torch.randn(n, 2 * i, generator=g)).to(dtype).to(device)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    out = torch.empty(n, i, dtype=dtype, device=device)
    silu_and_mul(gate, up, out)
    want = silu_and_mul_ref(gate, up)
    # exp differs in the last bits between libraries; the rounding points are the same
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("n,c", [(1, 576), (3, 100), (5, 1030)])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rms_norm(interpret, n, c, with_res):
    _check_norm(n, c, torch.float32, "cpu", with_res)


@pytest.mark.parametrize("n,hq,hkv,d", [(1, 9, 3, 64), (6, 4, 2, 18), (3, 2, 1, 10)])
def test_rope_and_cache(interpret, n, hq, hkv, d):
    _check_rope(n, hq, hkv, d, torch.float32, "cpu")


@pytest.mark.parametrize("n,hq,hkv,d", [(1, 9, 3, 64), (6, 4, 2, 18), (3, 2, 1, 10)])
def test_rope_and_fp8_cache_write_is_the_reference_bit_for_bit(interpret, n, hq, hkv, d):
    """kv_dtype=fp8: the fused write clamps to +-448 and rounds half-even exactly as
    kernels.kv_quant.quantize_kv, subnormals and ties included, byte for byte. fp32 only on
    CPU: the interpreter's bf16 rotation is not PyTorch's to the bit (nor is the GPU's, whose
    bf16 case is in the gpu tier below)."""
    _check_rope(n, hq, hkv, d, torch.float32, "cpu", kv_fp8=True)


@pytest.mark.parametrize("n,i", [(1, 1536), (4, 88), (2, 1500)])
def test_silu_and_mul(interpret, n, i):
    _check_silu(n, i, torch.float32, "cpu")


def test_wrappers_name_the_bad_argument(interpret):
    x = torch.zeros(2, 8)
    with pytest.raises(KernelArgumentError, match="weight"):
        add_rms_norm(x, None, torch.ones(7), 1e-6, torch.empty_like(x))
    q = torch.zeros(2, 4, 8)
    k = torch.zeros(2, 2, 8)
    cache = torch.zeros(3, 4, 2, 8)
    cos = torch.zeros(10, 8)
    with pytest.raises(KernelArgumentError, match="slot_mapping"):
        rope_and_cache(q, k, k, torch.zeros(2, dtype=torch.int64), cos, cos,
                       torch.zeros(3, dtype=torch.int64), cache, cache.clone(), torch.empty_like(q))
    with pytest.raises(KernelArgumentError, match="up"):
        silu_and_mul(x, torch.zeros(2, 9), torch.empty_like(x))


@pytest.mark.gpu
def test_fused_ops_bf16_on_cuda(cuda):
    for with_res in (False, True):
        _check_norm(7, 4096, torch.bfloat16, "cuda", with_res)
        _check_norm(1, 576, torch.bfloat16, "cuda", with_res)
    _check_rope(5, 32, 8, 128, torch.bfloat16, "cuda")
    _check_rope(1, 9, 3, 64, torch.bfloat16, "cuda")
    _check_rope(5, 32, 8, 128, torch.bfloat16, "cuda", kv_fp8=True)
    _check_silu(3, 14336, torch.bfloat16, "cuda")
