"""kernels.indexer_decode (one decode query per row against a tile of its own paged entries)
against kernels.indexer_decode_ref: head counts and dims not powers of two, tiles that start
mid-block and end past the kernel's tile, rows seeing nothing, every entry, or part of the tile.
CPU tier through the Triton interpreter; gpu tier in bf16 at V4-Flash's indexer widths.

Ties are made in exact arithmetic (small integers, so every sum is exact whatever its order):
equal keys alone do not give equal fp32 scores everywhere. The interpreter's ``tl.dot`` is
numpy's matmul, and OpenBLAS's AVX2 (Haswell) sgemm rounds some columns of a tile differently
from others (one ulp), so "all keys equal" was only a tie on AVX-512 machines
(``OPENBLAS_CORETYPE=Haswell`` reproduces the difference on any x86 machine)."""

from __future__ import annotations

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.indexer_decode import indexer_decode_scores
from kernels.indexer_decode_ref import indexer_decode_scores_ref


def _case(b, h, d, per, blocks, first, num, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    pool_blocks = b * blocks + 1
    keys = torch.randn(pool_blocks * per, d, generator=g).to(device, dtype)
    tables = (torch.randperm(pool_blocks - 1, generator=g)[: b * blocks] + 1).view(b, blocks)
    q = torch.randn(b, h, d, generator=g).to(device, dtype)
    w = torch.rand(b, h, generator=g).to(device)
    seen = (0, blocks * per, first + num // 2, first + 1, 3)  # nothing, all, part of the tile
    ends = torch.tensor([seen[i % len(seen)] for i in range(b)]).clamp(max=blocks * per)
    return q, w, keys, tables.to(device), ends.to(device)


def _exact(q, w, keys):
    """The same case in small integers (weights in quarters): every score is exact in fp32, so
    equal keys give equal scores and the tie rule alone orders them."""
    return q.round().clamp(-3, 3), (w * 4).round() / 4, keys.round().clamp(-3, 3)


@pytest.mark.parametrize("b,h,d,per,blocks,first,num", [
    (3, 5, 24, 4, 6, 2, 19), (1, 16, 32, 8, 3, 0, 24), (5, 3, 20, 2, 40, 7, 70), (2, 1, 16, 1, 9, 4, 5),
])
def test_indexer_decode_matches_reference(interpret, b, h, d, per, blocks, first, num):
    q, w, keys, tables, ends = _case(b, h, d, per, blocks, first, num, torch.float32, "cpu", b + h + d)
    out = torch.full((b, num), float("nan"))
    indexer_decode_scores(q, w, keys, tables, ends, first, num, per, out)
    torch.testing.assert_close(out, indexer_decode_scores_ref(q, w, keys, tables, ends, first,
                                                              num, per), rtol=1e-5, atol=1e-5)


def test_indexer_decode_names_the_bad_argument(interpret):
    q, w, keys, tables, ends = _case(2, 4, 16, 4, 3, 0, 8, torch.float32, "cpu", 0)
    out = torch.empty(2, 8)
    with pytest.raises(KernelArgumentError, match="num"):
        indexer_decode_scores(q, w, keys, tables, ends, 8, 8, 4, out)
    with pytest.raises(KernelArgumentError, match="keys"):
        indexer_decode_scores(q, w, keys[:, :8], tables, ends, 0, 8, 4, out)
    with pytest.raises(KernelArgumentError, match="kv_end"):
        indexer_decode_scores(q, w, keys, tables, ends.int(), 0, 8, 4, out)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 32])
def test_indexer_decode_on_cuda(cuda, b):
    q, w, keys, tables, ends = _case(b, 64, 128, 64, 64, 2048, 2048, torch.bfloat16, "cuda", b)
    out = torch.empty(b, 2048, device="cuda")
    indexer_decode_scores(q, w, keys, tables, ends, 2048, 2048, 64, out)
    torch.testing.assert_close(out, indexer_decode_scores_ref(q, w, keys, tables, ends, 2048,
                                                              2048, 64), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("b,h,d,per,blocks,topk,tile", [
    (5, 5, 24, 4, 7, 8, 8),     # 28 entries over 4 tiles (the last one partial)
    (3, 3, 20, 2, 9, 40, 5),    # top-k wider than the table: -1 padding; odd tile
    (2, 16, 32, 8, 3, 16, 64),  # one tile wider than the table
])
def test_indexer_decode_topk_matches_reference(interpret, b, h, d, per, blocks, topk, tile):
    from kernels.indexer_decode import indexer_decode_topk, indexer_decode_topk_workspace_bytes
    from kernels.indexer_decode_ref import entry_pool_rows_ref, indexer_decode_topk_ref

    q, w, keys, tables, ends = _case(b, h, d, per, blocks, 0, blocks * per // 2, torch.float32,
                                     "cpu", b * h + topk)
    out = torch.full((b, topk), 7, dtype=torch.int64)
    ws = torch.full((indexer_decode_topk_workspace_bytes(b, topk, min(tile, blocks * per)),),
                    0xFF, dtype=torch.uint8)  # dirty: every byte read must be written first
    for _ in range(2):
        indexer_decode_topk(q, w, keys, tables, ends, per, topk, tile, out, workspace=ws)
        assert torch.equal(out, indexer_decode_topk_ref(q, w, keys, tables, ends, per, topk))
    assert (out[ends == 0] == -1).all()
    # int32 out: the same picks as pool rows, what the sparse attention reads
    rows = torch.full((b, topk), 7, dtype=torch.int32)
    indexer_decode_topk(q, w, keys, tables, ends, per, topk, tile, rows, workspace=ws)
    assert torch.equal(rows, entry_pool_rows_ref(out, tables, per))


def test_indexer_decode_topk_ties_go_to_the_lower_entry(interpret):
    """Every key equal: all visible scores tie, so the first ``topk`` entries win, in order."""
    from kernels.indexer_decode import indexer_decode_topk

    b, h, d, per, blocks = 2, 4, 16, 4, 5
    q, w, keys, tables, _ = _case(b, h, d, per, blocks, 0, 8, torch.float32, "cpu", 3)
    q, w, keys = _exact(q, w, keys)
    keys[:] = keys[0]
    w[:, 0] = 1.0  # and the tie is not at zero
    q[:, 0] = keys[0].sign()
    ends = torch.tensor([17, 3])
    out = torch.empty(b, 6, dtype=torch.int64)
    indexer_decode_topk(q, w, keys, tables, ends, per, 6, 8, out)
    assert out.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]]


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_indexer_decode_topk_merged_in_parts(interpret, parts):
    """A tile's merge split over ``parts`` programs a row, each into its own best, then
    combined: the same picks as the reference (and as one part), over tiles whose slices are
    partly past a row's end, rows of different lengths and one with nothing visible."""
    from kernels.indexer_decode import indexer_decode_topk, indexer_decode_topk_workspace_bytes
    from kernels.indexer_decode_ref import indexer_decode_topk_ref

    b, h, d, per, blocks, topk, tile = 4, 4, 16, 8, 30, 12, 100
    q, w, keys, tables, _ = _case(b, h, d, per, blocks, 0, 8, torch.float32, "cpu", parts)
    ends = torch.tensor([240, 131, 0, 17])
    ws = torch.full((indexer_decode_topk_workspace_bytes(b, topk, tile, parts),), 0xFF,
                    dtype=torch.uint8)
    out = torch.full((b, topk), 7, dtype=torch.int64)
    for _ in range(2):  # the parts' bests start over each call
        indexer_decode_topk(q, w, keys, tables, ends, per, topk, tile, out, workspace=ws,
                            parts=parts)
        assert torch.equal(out, indexer_decode_topk_ref(q, w, keys, tables, ends, per, topk))
    q, w, keys = _exact(q, w, keys)
    keys[:] = keys[0]  # all tie: the lowest entries win, whichever part holds them
    w[:, 0] = 1.0  # and the tie is not at zero
    q[:, 0] = keys[0].sign()
    indexer_decode_topk(q, w, keys, tables, ends, per, topk, tile, out, parts=parts)
    assert torch.equal(out, indexer_decode_topk_ref(q, w, keys, tables, ends, per, topk))
    assert out[3].tolist() == list(range(12))
    assert out[2].tolist() == [-1] * 12


@pytest.mark.parametrize("seed", range(4))
def test_indexer_decode_topk_random_ties_any_parts(interpret, seed):
    """Property: with scores full of exact ties (keys drawn from a few integer vectors, so many
    entries score the same), any tile and any number of merge parts pick what the reference
    picks (higher score, then the lower entry), and what the prefill indexer picks from the
    same keys laid out contiguously; int32 out gives the same picks as pool rows."""
    from kernels import indexer_topk
    from kernels.indexer_decode import indexer_decode_topk, indexer_decode_topk_workspace_bytes
    from kernels.indexer_decode_ref import entry_pool_rows_ref, indexer_decode_topk_ref

    g = torch.Generator().manual_seed(1000 + seed)

    def pick(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    for _ in range(3):
        b, h, d, per, blocks = pick(1, 4), pick(1, 6), pick(2, 5) * 4, pick(1, 8), pick(2, 24)
        num = blocks * per
        # tiles from a twelfth of the table to wider than it; parts' slices are whole multiples of
        # the padded top-k wide, so several parts hold entries only when topk is small
        topk, tile, parts = pick(1, 24), pick(max(1, num // 12), num + 8), pick(1, 8)
        pool_blocks = b * blocks + 1
        tables = (torch.randperm(pool_blocks - 1, generator=g)[: b * blocks] + 1).view(b, blocks)
        distinct = torch.randint(-2, 3, (pick(1, 8), d), generator=g).float()
        keys = distinct[torch.randint(0, distinct.shape[0], (pool_blocks * per,), generator=g)]
        q = torch.randint(-2, 3, (b, h, d), generator=g).float()
        w = torch.randint(-4, 5, (b, h), generator=g) / 4
        ends = torch.randint(0, num + 1, (b,), generator=g)
        ends[0] = num  # one row sees its whole table
        case = dict(b=b, h=h, d=d, per=per, blocks=blocks, topk=topk, tile=tile, parts=parts,
                    ends=ends.tolist())
        want = indexer_decode_topk_ref(q, w, keys, tables, ends, per, topk)
        ws = torch.full((indexer_decode_topk_workspace_bytes(b, topk, min(tile, num), parts),),
                        0xFF, dtype=torch.uint8)
        got = torch.full((b, topk), 7, dtype=torch.int64)
        indexer_decode_topk(q, w, keys, tables, ends, per, topk, tile, got, workspace=ws,
                            parts=parts)
        assert torch.equal(got, want), case
        rows = torch.full((b, topk), 7, dtype=torch.int32)
        indexer_decode_topk(q, w, keys, tables, ends, per, topk, tile, rows, workspace=ws,
                            parts=parts)
        assert torch.equal(rows, entry_pool_rows_ref(want, tables, per)), case
        for r in range(b):  # the prefill path over row r's entries in entry order
            e = torch.arange(num)
            k_r = keys[tables[r, e // per] * per + e % per]
            _, prefill = indexer_topk(q[r:r + 1], k_r, w[r:r + 1],
                                      ends[r:r + 1].to(torch.int32), topk)
            assert prefill[0].tolist() == want[r].tolist(), (r, case)


def test_merge_parts_rule_and_bounds(interpret):
    from kernels.indexer_decode import (
        MERGE_PARTS_MAX,
        indexer_decode_topk,
        indexer_decode_topk_workspace_bytes,
        merge_parts,
    )

    assert merge_parts(256) == 1 and merge_parts(16384) == 2 and merge_parts(32768) == 4
    assert merge_parts(1 << 20) == 4 and MERGE_PARTS_MAX == 8
    one = indexer_decode_topk_workspace_bytes(2, 512, 256)
    assert one == 2 * (256 * 4 + 3 * 512 * 8 + 512 * 4)  # as before the parts
    assert indexer_decode_topk_workspace_bytes(2, 512, 256, 3) == one + 2 * 7 * 512 * 8
    q, w, keys, tables, ends = _case(1, 2, 16, 4, 4, 0, 8, torch.float32, "cpu", 0)
    with pytest.raises(KernelArgumentError, match="parts"):
        indexer_decode_topk(q, w, keys, tables, ends, 4, 4, 8, torch.empty(1, 4,
                            dtype=torch.int64), parts=9)
    with pytest.raises(KernelArgumentError, match="workspace"):  # sized for fewer parts
        indexer_decode_topk(q, w, keys, tables, ends, 4, 4, 16, torch.empty(1, 4,
                            dtype=torch.int64), parts=4,
                            workspace=torch.empty(indexer_decode_topk_workspace_bytes(1, 4, 16, 1),
                                                  dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 3])
def test_indexer_decode_topk_parts_on_cuda(cuda, b):
    """V4-Flash's decode tile (top-512 of 32,768 entries, 64 heads x 128): the merge on 4 (the
    default) and 8 programs a row picks exactly what one program picks, and that is the
    reference's top-512 but for near ties its fp32 sums may order otherwise."""
    from kernels.indexer_decode import indexer_decode_topk, merge_parts
    from kernels.indexer_decode_ref import indexer_decode_topk_ref

    q, w, keys, tables, _ = _case(b, 64, 128, 64, 512, 0, 8, torch.bfloat16, "cuda", b)
    ends = torch.tensor([32768, 20001, 700][:b], device="cuda")
    want = indexer_decode_topk_ref(q, w, keys, tables, ends, 64, 512)
    assert merge_parts(32768) == 4
    got = {}
    for parts in (1, 4, 8):
        got[parts] = torch.empty(b, 512, dtype=torch.int64, device="cuda")
        indexer_decode_topk(q, w, keys, tables, ends, 64, 512, 32768, got[parts], parts=parts)
    assert torch.equal(got[4], got[1]) and torch.equal(got[8], got[1])
    for r in range(b):
        same = len(set(got[1][r].tolist()) & set(want[r].tolist()))
        assert same >= 508, (r, same)


def _fp8_keys(keys: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` stored as an FP8 pool stores them: e4m3 rows and an fp32 scale a row (random
    scales, so a kernel that dropped them would pick other entries)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(keys.shape[0], generator=g) * 0.5 + 0.01
    return (keys / scale[:, None]).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("b,h,d,per,blocks,first,num", [
    (3, 5, 24, 4, 6, 2, 19), (5, 3, 20, 2, 40, 7, 70),
])
def test_fp8_keys_scored_with_their_scales(interpret, b, h, d, per, blocks, first, num):
    """FP8 keys (an FP8 KV pool's indexer entries) with a scale a row: the kernel dequantises
    each row in fp32 and scores as the reference does on the dequantised keys."""
    q, w, keys, tables, ends = _case(b, h, d, per, blocks, first, num, torch.float32, "cpu", b + d)
    k8, scale = _fp8_keys(keys, b)
    out = torch.full((b, num), float("nan"))
    indexer_decode_scores(q, w, k8, tables, ends, first, num, per, out, key_scale=scale)
    ref = indexer_decode_scores_ref(q, w, k8, tables, ends, first, num, per, key_scale=scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    deq = indexer_decode_scores_ref(q, w, k8.float() * scale[:, None], tables, ends, first, num,
                                    per)
    torch.testing.assert_close(ref, deq, rtol=0, atol=0)  # the reference's scale is the pool's
    assert not torch.allclose(ref[ref.isfinite()], indexer_decode_scores_ref(
        q, w, k8.float(), tables, ends, first, num, per)[ref.isfinite()])


def test_fp8_keys_top_k_matches_reference(interpret):
    """The whole-table top-k over FP8 keys: the entries picked carry the reference's best
    scores (compared by score, so a tie between FP8-rounded keys may go either way)."""
    from kernels.indexer_decode import indexer_decode_topk
    from kernels.indexer_decode_ref import indexer_decode_topk_ref

    b, h, d, per, blocks, topk, tile = 4, 4, 16, 8, 30, 12, 100
    q, w, keys, tables, _ = _case(b, h, d, per, blocks, 0, 8, torch.float32, "cpu", 5)
    k8, scale = _fp8_keys(keys, 6)
    ends = torch.tensor([240, 131, 0, 17])
    out = torch.full((b, topk), 7, dtype=torch.int64)
    indexer_decode_topk(q, w, k8, tables, ends, per, topk, tile, out, key_scale=scale)
    ref = indexer_decode_topk_ref(q, w, k8, tables, ends, per, topk, key_scale=scale)
    sc = indexer_decode_scores_ref(q, w, k8, tables, ends, 0, blocks * per, per, key_scale=scale)
    assert torch.equal(out == -1, ref == -1)
    got = torch.where(out >= 0, sc.gather(1, out.clamp(min=0)), float("-inf"))
    want = torch.where(ref >= 0, sc.gather(1, ref.clamp(min=0)), float("-inf"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fp8_keys_need_their_scales(interpret):
    q, w, keys, tables, ends = _case(2, 4, 16, 4, 3, 0, 8, torch.float32, "cpu", 0)
    k8, scale = _fp8_keys(keys, 0)
    out = torch.empty(2, 8)
    with pytest.raises(KernelArgumentError, match="keys"):
        indexer_decode_scores(q, w, k8, tables, ends, 0, 8, 4, out)  # FP8 without scales
    with pytest.raises(KernelArgumentError, match="key_scale"):
        indexer_decode_scores(q, w, k8, tables, ends, 0, 8, 4, out, key_scale=scale[:-1])
