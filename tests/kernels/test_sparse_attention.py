"""sparse_attention (Triton, interpreted on CPU) against sparse_attention_ref, and the reference
against transformers' DeepSeek-V4 eager attention (sliding window + compressed entries + sinks)."""

from __future__ import annotations

import types

import pytest
import torch

from kernels import (
    KernelArgumentError,
    SparseTiles,
    sparse_attention,
    sparse_attention_ref,
    sparse_attention_workspace_bytes,
)


def _case(s, h, d, nw, nc, k_idx, *, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, h, d, generator=g).to(dtype)
    wkv = torch.randn(nw, d, generator=g).to(dtype)
    ckv = torch.randn(nc, d, generator=g).to(dtype)
    ws = torch.randint(0, nw, (s,), generator=g, dtype=torch.int32)
    we = torch.minimum(ws + torch.randint(0, 40, (s,), generator=g, dtype=torch.int32),
                       torch.tensor(nw, dtype=torch.int32))
    idx = torch.randint(-1, nc, (s, k_idx), generator=g, dtype=torch.int32)
    cs = torch.randint(0, nc, (s,), generator=g, dtype=torch.int32)
    ce = torch.minimum(cs + torch.randint(0, 50, (s,), generator=g, dtype=torch.int32),
                       torch.tensor(nc, dtype=torch.int32))
    sinks = torch.randn(h, generator=g)
    return q, wkv, ws, we, ckv, idx, cs, ce, sinks


@pytest.mark.parametrize(
    ("s", "h", "d", "kind", "dtype"),
    [
        (5, 3, 40, "csa", torch.float32),
        (4, 20, 24, "hca", torch.bfloat16),  # heads not a multiple of the head block
        (3, 33, 64, "both", torch.float32),  # two head blocks
        (6, 1, 16, "window", torch.bfloat16),
    ],
)
def test_flat_matches_reference(interpret, s, h, d, kind, dtype) -> None:
    q, wkv, ws, we, ckv, idx, cs, ce, sinks = _case(s, h, d, 60, 45, 37, seed=s + h, dtype=dtype)
    we[0] = ws[0]  # a row with an empty window
    kw = {"scale": d**-0.5, "sinks": sinks if kind != "window" else None}
    if kind in ("csa", "both"):
        kw |= {"compressed_kv": ckv, "indices": idx}
    if kind in ("hca", "both"):
        kw |= {"compressed_kv": ckv, "compressed_start": cs, "compressed_end": ce}
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, wkv, ws, we, out=out, **kw)
    ref = sparse_attention_ref(q, wkv, ws, we, **kw)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_paged_window_matches_reference(interpret) -> None:
    s, h, d, block = 5, 4, 32, 4
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(12, block, 1, d, generator=g)  # our KV layout with one KV head
    tables = torch.tensor([[3, 7, 1, 9, 2], [4, 5, 6, 8, 10]], dtype=torch.int32)
    row_seq = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    pos = torch.tensor([6, 13, 0, 9, 19], dtype=torch.int32)
    window = 5
    ws, we = torch.clamp(pos - window + 1, min=0), pos + 1
    q = torch.randn(s, h, d, generator=g)
    out = torch.empty_like(q)
    kw = {"scale": 0.3, "window_block_tables": tables, "row_seq": row_seq}
    sparse_attention(q, cache, ws, we, out=out, **kw)
    ref = sparse_attention_ref(q, cache, ws, we, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_empty_row_without_sink_is_zero(interpret) -> None:
    q = torch.randn(2, 3, 16)
    wkv = torch.randn(4, 16)
    zero = torch.zeros(2, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, wkv, zero, zero, scale=1.0, out=out)
    assert torch.equal(out, torch.zeros_like(q))


def test_reference_matches_transformers_deepseek_v4_attention() -> None:
    """Our reference computes what DeepseekV4Attention's eager path computes."""
    mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    g = torch.Generator().manual_seed(5)
    heads, d, window, p0, s, nc, topk = 4, 32, 4, 10, 6, 5, 3
    kv_raw = torch.randn(p0 + s, d, generator=g)  # K == V, positions 0 .. p0+s-1
    comp = torch.randn(nc, d, generator=g)
    q = torch.randn(s, heads, d, generator=g)
    sinks = torch.randn(heads, generator=g)
    idx = torch.randint(-1, nc, (s, topk), generator=g, dtype=torch.int32)
    idx[:, 0] = torch.arange(s) % nc  # distinct picks, as the indexer gives
    idx[:, 1] = -1
    pos = torch.arange(p0, p0 + s)
    j = torch.arange(p0 + s)
    visible = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - window)
    bias = torch.full((s, nc + 1), float("-inf"))
    bias.scatter_(1, torch.where(idx >= 0, idx, nc).long(), 0.0)
    mask = torch.cat([torch.where(visible, 0.0, float("-inf")), bias[:, :nc]], dim=1)
    module = types.SimpleNamespace(num_key_value_groups=heads, sinks=sinks, training=False)
    kv_all = torch.cat([kv_raw, comp])[None, None]
    expected, _ = mod.eager_attention_forward(module, q.transpose(0, 1)[None], kv_all, kv_all,
                                              mask[None, None], scaling=d**-0.5)
    ours = sparse_attention_ref(q, kv_raw, (pos - window + 1).clamp(min=0).int(),
                                (pos + 1).int(), scale=d**-0.5, compressed_kv=comp,
                                indices=idx, sinks=sinks)
    torch.testing.assert_close(ours, expected[0], rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments(interpret) -> None:
    q, wkv, ws, we, ckv, idx, *_ = _case(3, 2, 16, 20, 10, 4, seed=1, dtype=torch.float32)
    out = torch.empty_like(q)
    with pytest.raises(KernelArgumentError, match="compressed_kv"):
        sparse_attention(q, wkv, ws, we, scale=1.0, out=out, indices=idx)
    with pytest.raises(KernelArgumentError, match="window_kv"):
        sparse_attention(q, wkv[:, :8], ws, we, scale=1.0, out=out)
    with pytest.raises(KernelArgumentError, match="row_seq"):
        sparse_attention(q, wkv.view(5, 4, 16), ws, we, scale=1.0, out=out,
                         window_block_tables=torch.zeros(1, 5, dtype=torch.int32))


@pytest.mark.parametrize("tiles", [SparseTiles(64, 32, 8, 2), SparseTiles(16, 16, 4, 2)])
def test_explicit_tiles_give_the_same_answer(interpret, tiles) -> None:
    q, wkv, ws, we, ckv, idx, cs, ce, sinks = _case(3, 33, 32, 50, 40, 20, seed=9,
                                                    dtype=torch.float32)
    kw = {"scale": 0.2, "compressed_kv": ckv, "indices": idx, "sinks": sinks}
    out = torch.empty_like(q)
    sparse_attention(q, wkv, ws, we, out=out, tiles=tiles, **kw)
    ref = sparse_attention_ref(q, wkv, ws, we, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("num_splits", "sinks"), [(3, True), (2, False)])
def test_split_entries_give_the_same_answer(interpret, num_splits, sinks) -> None:
    q, wkv, ws, we, ckv, idx, cs, ce, sink = _case(4, 5, 24, 60, 45, 37, seed=13,
                                                   dtype=torch.float32)
    we[1] = ws[1]  # empty window
    idx[2] = -1  # no indexed entries
    kw = {"scale": 0.25, "compressed_kv": ckv, "indices": idx, "compressed_start": cs,
          "compressed_end": ce, "sinks": sink if sinks else None}
    need = sparse_attention_workspace_bytes(4, 5, 24, num_splits)
    ws_buf = torch.empty(need, dtype=torch.uint8)
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, wkv, ws, we, out=out, num_splits=num_splits, workspace=ws_buf,
                     tiles=SparseTiles(16, 16, 4, 2), **kw)
    ref = sparse_attention_ref(q, wkv, ws, we, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelArgumentError, match="workspace"):
        sparse_attention(q, wkv, ws, we, out=out, num_splits=num_splits, workspace=ws_buf[:8],
                         **kw)


def test_decode_splits_fill_the_gpu_only_where_rows_are_few() -> None:
    """V4-Flash's 64 heads in 16-head programs: batch 1 splits a CSA row's 640 entries 4 ways
    and an HCA row's 8,320 (1M context) 16 ways; a sliding layer's 128 and 32 rows stay whole;
    the grid never passes the target, and a split keeps at least two 64-entry tiles."""
    from kernels.sparse_attention import SPLIT_TARGET_PROGRAMS, decode_attention_splits

    assert decode_attention_splits(1, 64, 640) == 4
    assert decode_attention_splits(1, 64, 8320) == 16
    assert decode_attention_splits(1, 64, 128) == 1
    assert decode_attention_splits(32, 64, 8320) == 1
    assert decode_attention_splits(4096, 64, 8320) == 1  # prefill
    for rows in range(1, 40):
        for entries in (100, 640, 3000, 8320):
            s = decode_attention_splits(rows, 64, entries)
            assert s == 1 or (rows * 4 * s <= SPLIT_TARGET_PROGRAMS and entries >= s * 2 * 64)
