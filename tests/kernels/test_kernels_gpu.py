"""GPU tier: the kernels compiled for real, at realistic shapes, against the references."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import (
    default_decode_splits,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_workspace_bytes,
    paged_attention,
    paged_attention_ref,
    paged_decode_attention,
    paged_decode_workspace_bytes,
    sparse_attention,
    sparse_attention_ref,
    sparse_attention_workspace_bytes,
)
from kernels.kv_quant import KV_FP8_DTYPE, quantize_kv
from lab.bench.sparse_case import realistic_sparse_inputs

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _allocations(fn: Callable[[], object]) -> int:
    """Device allocations made by a second call of ``fn`` (the first compiles the kernel)."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


@pytest.mark.parametrize(("s", "t", "topk"), [(1000, 20000, 512), (257, 3001, 2048), (64, 100, 512)])
def test_indexer_exact_on_integers_and_allocation_free(cuda, s, t, topk) -> None:
    g = torch.Generator(device="cuda").manual_seed(s)
    q = torch.randint(-2, 3, (s, 64, 128), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randint(-2, 3, (t, 128), device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (s, 64), device="cuda", generator=g).float()
    kv_end = torch.randint(0, t + 1, (s,), device="cuda", generator=g, dtype=torch.int32)
    ws = torch.empty(indexer_topk_workspace_bytes(s, 64, 128, t, topk), dtype=torch.uint8,
                     device="cuda")
    out_s = torch.full((s, topk), 7.0, device="cuda")
    out_i = torch.full((s, topk), -9, dtype=torch.int32, device="cuda")
    indexer_topk(q, k, w, kv_end, topk, out_indices=out_i, out_scores=out_s, workspace=ws)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    indexer_topk(q, k, w, kv_end, topk, out_indices=out_i, out_scores=out_s, workspace=ws)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    ref_s, ref_i = indexer_topk_ref(q, k, w, kv_end, topk, row_block=256)
    assert torch.equal(out_i, ref_i)
    assert torch.equal(out_s, ref_s)


def test_indexer_random_close_to_reference(cuda) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    s, t, topk = 512, 40000, 512
    q = torch.randn(s, 64, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(t, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(s, 64, device="cuda", generator=g) / 8
    kv_end = torch.full((s,), t, dtype=torch.int32, device="cuda")
    got_s, got_i = indexer_topk(q, k, w, kv_end, topk)
    ref_s, ref_i = indexer_topk_ref(q, k, w, kv_end, topk)
    torch.testing.assert_close(got_s, ref_s, rtol=1e-4, atol=1e-3)
    # near-equal scores may swap places under a different fp32 summation order, nothing more
    assert (got_i == ref_i).float().mean() > 0.95


def test_sparse_attention_realistic(cuda) -> None:
    q, win, t, end, kw = realistic_sparse_inputs()
    out = torch.full_like(q, float("nan"))
    assert _allocations(lambda: sparse_attention(q, win, t, end, out=out, **kw)) == 0
    ref = sparse_attention_ref(q, win, t, end, **kw)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(("q_lens", "ctx"), [([2048], [2048]), ([1000, 1, 333], [5000, 77, 333])])
def test_paged_prefill_realistic(cuda, q_lens, ctx, kv_dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    hq, hkv, d, bs = 32, 8, 128, 16
    blocks = [-(-c // bs) for c in ctx]
    kc = torch.randn(sum(blocks) + 1, bs, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    if kv_dtype == "fp8":  # the cache as kv_dtype=fp8 stores it; q and out stay bf16
        kc, vc = quantize_kv(kc, KV_FP8_DTYPE), quantize_kv(vc, KV_FP8_DTYPE)
    perm = torch.randperm(sum(blocks), device="cuda", generator=g) + 1
    tables = torch.zeros(len(ctx), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[off : off + n]
        off += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                       device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g).to(torch.bfloat16)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    assert _allocations(lambda: paged_attention(q, kc, vc, tables, qsl, ctx_t, d**-0.5, out)) == 0
    ref = paged_attention_ref(q, kc, vc, tables, qsl, ctx_t, d**-0.5)
    assert _rel(out, ref) < 1e-2
    b = len(ctx)
    dq = torch.randn(b, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    splits = default_decode_splits(b, hkv, max(ctx), 132)
    ws = torch.empty(max(paged_decode_workspace_bytes(b, hq, d, splits), 1), dtype=torch.uint8,
                     device="cuda")
    dout = torch.full_like(dq, float("nan"))
    assert _allocations(lambda: paged_decode_attention(
        dq, kc, vc, tables, ctx_t, d**-0.5, dout, num_splits=splits, workspace=ws)) == 0
    one = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    dref = paged_attention_ref(dq, kc, vc, tables, one, ctx_t, d**-0.5)
    assert _rel(dout, dref) < 1e-2


def test_indexer_fp8_exact_on_integers(cuda) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    s, t, topk = 777, 30001, 512
    q = torch.randint(-2, 3, (s, 64, 128), device="cuda", generator=g).float()
    k = torch.randint(-2, 3, (t, 128), device="cuda", generator=g).float()
    w = torch.randint(-2, 3, (s, 64), device="cuda", generator=g).float()
    qs = 2.0 ** torch.randint(-2, 3, (s, 64), device="cuda", generator=g).float()
    ks = 2.0 ** torch.randint(-2, 3, (t,), device="cuda", generator=g).float()
    kv_end = torch.randint(0, t + 1, (s,), device="cuda", generator=g, dtype=torch.int32)
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    got_s, got_i = indexer_topk(q8, k8, w, kv_end, topk, q_scale=qs, k_scale=ks)
    ref_s, ref_i = indexer_topk_ref(q8, k8, w, kv_end, topk, row_block=256, q_scale=qs,
                                    k_scale=ks)
    assert torch.equal(got_i, ref_i)
    assert torch.equal(got_s, ref_s)


def test_sparse_attention_split_decode(cuda) -> None:
    g = torch.Generator(device="cuda").manual_seed(4)
    s, h, d, window, topk, nc = 64, 64, 512, 128, 512, 50000
    q = torch.randn(s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    win = torch.randn(s * window, d, device="cuda", generator=g).to(torch.bfloat16)
    comp = torch.randn(nc, d, device="cuda", generator=g).to(torch.bfloat16)
    start = torch.arange(s, device="cuda", dtype=torch.int32) * window
    idx = torch.randint(-1, nc, (s, topk), device="cuda", generator=g, dtype=torch.int32)
    sinks = torch.randn(h, device="cuda", generator=g)
    kw = {"scale": d**-0.5, "compressed_kv": comp, "indices": idx, "sinks": sinks}
    ws = torch.empty(sparse_attention_workspace_bytes(s, h, d, 4), dtype=torch.uint8,
                     device="cuda")
    out = torch.full_like(q, float("nan"))
    end = start + window
    assert _allocations(lambda: sparse_attention(q, win, start, end, out=out,
                                                 num_splits=4, workspace=ws, **kw)) == 0
    ref = sparse_attention_ref(q, win, start, start + window, **kw)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize(("m", "n", "k"), [(1, 32768, 1024), (7, 4096, 4000), (4096, 1024, 4096)])
def test_fp8_linear_at_v4_shapes_allocation_free(cuda, m, n, k) -> None:
    """With the scratch the planner counts and the model's counters (as Fp8Linear passes them),
    no allocation; (7, 4096, 4000) splits K and sums its partials in its own launch on the GPU
    (atomics, barrier): the counters are left zero and the result matches the reference."""
    from kernels.fp8_linear import fp8_linear, fp8_linear_scratch_bytes, gemv_semaphores
    from kernels.fp8_linear_ref import fp8_linear_ref

    g = torch.Generator(device="cuda").manual_seed(m)
    q = (torch.randn(n, k, device="cuda", generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=g) * 1e-2
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    need = fp8_linear_scratch_bytes(m, n, k)
    assert (need > 0) == (m == 7)
    ws = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")
    sem = gemv_semaphores("cuda")
    for _ in range(3):
        assert _allocations(lambda: fp8_linear(x, q, s, out, workspace=ws, semaphores=sem)) == 0
        assert _rel(out, fp8_linear_ref(x.float(), q, s)) < 1e-2
        assert not sem.any()
    import kernels.fp8_linear as fl

    two = torch.empty_like(out)
    fl.SERIAL_SPLIT_REDUCE = False
    try:  # the two-launch reduce: the same sum in the same order, so the same bits
        fp8_linear(x, q, s, two, workspace=ws, semaphores=sem)
    finally:
        fl.SERIAL_SPLIT_REDUCE = True
    assert torch.equal(out, two)


@pytest.mark.parametrize("tokens", [1, 32, 2048])
def test_mxfp4_moe_at_v4_shapes_allocation_free(cuda, tokens) -> None:
    from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes
    from kernels.mxfp4_moe_ref import moe_experts_ref

    e, hid, inter, k = 64, 4096, 2048, 6
    g = torch.Generator(device="cuda").manual_seed(tokens)
    u8 = dict(device="cuda", generator=g, dtype=torch.uint8)
    gu, dn = torch.randint(0, 256, (e, 2 * inter, hid // 2), **u8), torch.randint(0, 256, (e, hid, inter // 2), **u8)
    gus, dns = torch.randint(118, 122, (e, 2 * inter, hid // 32), **u8), torch.randint(118, 122, (e, hid, inter // 32), **u8)
    x = torch.randn(tokens, hid, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (tokens, k), device="cuda", generator=g)
    w = torch.rand(tokens, k, device="cuda", generator=g)
    out = torch.empty(tokens, hid, device="cuda", dtype=torch.bfloat16)
    ws = torch.empty(moe_experts_workspace_bytes(tokens, k, hid, inter, e), dtype=torch.uint8, device="cuda")
    # torch.sort may take cub scratch from the caching allocator: cached after the first call
    assert _allocations(lambda: moe_experts(x, w, ids, gu, gus, dn, dns, 10.0, out, workspace=ws)) == 0
    n = min(tokens, 64)
    ref = moe_experts_ref(x[:n].float(), w[:n], ids[:n], gu, gus, dn, dns, 10.0)
    assert _rel(out[:n], ref) < 2e-2
