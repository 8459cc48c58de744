"""The measurement cases behind ``python -m lab.bench.kernels``: inputs, timing, checks, one dict a row.

Every case takes its sizes from ``BenchShapes`` (the issue's shapes by default, toy sizes for
``--smoke``) and a ``timer(fn, rep_ms) -> ms``. Measurement code only: the engine must never
import it; it allocates freely.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch

# every kernel and its reference through the package's public names
import kernels as K  # every kernel and its reference, by their public names

MIB = 1024**2
NOMINAL_TFLOPS = 790.0  # bf16 dense on an H200, as the issue states it
Timer = Callable[[Callable[[], object], int], float]


@dataclass(frozen=True)
class BenchShapes:
    """Sizes of every case; the defaults are the issue's."""

    rows: int = 4096
    heads: int = 64
    dim: int = 128
    topk: int = 512
    contexts: tuple[int, ...] = (16384, 153600, 262144, 1048576)
    sweep_context: int = 262144
    tiles: K.IndexerTiles = K.IndexerTiles()
    ref_row_block: int = 256
    index_candidates: tuple[K.IndexerTiles, ...] = tuple(
        K.IndexerTiles(block_m=m, block_n=n, num_warps=w, num_stages=s)
        for (m, n, w, s) in ((64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (64, 256, 8, 2),
                             (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2))
    )
    sparse_cases: tuple[tuple[int, int], ...] = ((4096, 262144), (64, 262144), (64, 1048576))
    sparse_heads: int = 64
    sparse_dim: int = 512
    window: int = 128
    sparse_topk: int = 512
    sparse_splits: tuple[int, ...] = (2, 4, 8)
    sparse_candidates: tuple[K.SparseTiles, ...] = (
        K.SparseTiles(64, 32, 8, 2), K.SparseTiles(64, 64, 8, 2), K.SparseTiles(64, 32, 8, 3),
        K.SparseTiles(32, 64, 8, 2), K.SparseTiles(16, 64, 4, 2), K.SparseTiles(16, 32, 4, 3),
    )
    prefill_cases: tuple[tuple[int, int], ...] = ((4096, 4096), (4096, 32768), (512, 8192))
    decode_cases: tuple[tuple[int, int], ...] = (
        (1, 32768), (16, 4096), (16, 32768), (64, 4096), (64, 32768))
    paged_heads: tuple[int, int] = (32, 8)
    paged_dim: int = 128
    block_size: int = 16
    paged_candidates: tuple[K.PagedTiles, ...] = (
        K.PagedTiles(64, 64, 4, 2), K.PagedTiles(128, 64, 8, 2), K.PagedTiles(128, 32, 8, 3),
        K.PagedTiles(64, 32, 4, 3),
    )
    check_rows: int = 128  # rows compared against the (slow) references in attention cases

    @staticmethod
    def smoke() -> BenchShapes:
        return BenchShapes(
            rows=24, heads=3, dim=32, topk=16, contexts=(400,), sweep_context=400,
            tiles=K.IndexerTiles(tile_w=64, block_m=16, block_n=32),
            ref_row_block=8,
            index_candidates=(K.IndexerTiles(tile_w=64, block_m=16, block_n=32),
                              K.IndexerTiles(tile_w=64, block_m=16, block_n=16)),
            sparse_cases=((6, 400),), sparse_heads=3, sparse_dim=32, window=8, sparse_topk=16,
            sparse_candidates=(K.SparseTiles(16, 16, 4, 2),),
            prefill_cases=((20, 20), (7, 50)), decode_cases=((2, 50),), paged_heads=(4, 2),
            paged_dim=32, block_size=4, paged_candidates=(K.PagedTiles(16, 16, 4, 2),),
            check_rows=4,
        )


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=_device()).manual_seed(seed)


def _indexer_inputs(sh: BenchShapes, num_keys: int, context: int, integer: bool, seed: int):
    g, dev = _gen(seed), _device()
    rows, heads, dim = sh.rows, sh.heads, sh.dim
    if integer:  # exact arithmetic: products and sums of small integers are exact in fp32
        q = torch.randint(-2, 3, (rows, heads, dim), device=dev, generator=g).to(torch.bfloat16)
        k = torch.randint(-2, 3, (num_keys, dim), device=dev, generator=g).to(torch.bfloat16)
        w = torch.randint(-2, 3, (rows, heads), device=dev, generator=g).float()
    else:
        q = torch.randn(rows, heads, dim, device=dev, generator=g).to(torch.bfloat16)
        k = torch.randn(num_keys, dim, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(rows, heads, device=dev, generator=g) * heads**-0.5
    # The chunk is the last `rows` tokens of the context; keys compressed 4x: causal ends.
    pos = torch.arange(context - rows, context, device=dev)
    kv_end = ((pos + 1) // 4).clamp(max=num_keys).to(torch.int32)
    return q, k, w, kv_end


def _peak_above(fn: Callable[[], object]) -> tuple[float | None, object]:
    if not torch.cuda.is_available():
        return None, fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MIB, result


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one scale per vector along the last dim (per token, or per token and head)."""
    scale = x.float().abs().amax(dim=-1).clamp(min=1e-12) / 448.0
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def _fp8_figures(sh: BenchShapes, context: int, call: Callable, timer: Timer, check: bool,
                 out_i: torch.Tensor) -> dict:
    num_keys = context // 4
    res: dict = {}
    q, k, w, kv_end = _indexer_inputs(sh, num_keys, context, integer=True, seed=1)
    g = _gen(9)
    qs = 2.0 ** torch.randint(-2, 3, q.shape[:2], device=q.device, generator=g).float()
    ks = 2.0 ** torch.randint(-2, 3, k.shape[:1], device=q.device, generator=g).float()
    q8, k8 = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
    call(q8, k8, w, kv_end, sh.topk, q_scale=qs, k_scale=ks)
    if check:
        _, ref_i = K.indexer_topk_ref(q8, k8, w, kv_end, sh.topk, row_block=sh.ref_row_block,
                                    q_scale=qs, k_scale=ks)
        res["fp8_indices_identical"] = bool(torch.equal(ref_i, out_i))
    q, k, w, kv_end = _indexer_inputs(sh, num_keys, context, integer=False, seed=2)
    q8, qs = _quantize(q)
    k8, ks = _quantize(k)
    res["fp8_ms_randn"] = timer(partial(call, q8, k8, w, kv_end, sh.topk, q_scale=qs,
                                        k_scale=ks), 300)
    flops = 2 * sh.rows * sh.heads * sh.dim * num_keys
    res["fp8_pct_of_bf16_limit"] = 100 * flops / (NOMINAL_TFLOPS * 1e9) / res["fp8_ms_randn"]
    if check:
        _, ref_i = K.indexer_topk_ref(q8, k8, w, kv_end, sh.topk, row_block=sh.ref_row_block,
                                    q_scale=qs, k_scale=ks)
        res["fp8_randn_index_agreement"] = float((ref_i == out_i).float().mean())
    return res


def _indexer_row(sh: BenchShapes, context: int, tiles: K.IndexerTiles, timer: Timer, check: bool,
                 naive: bool, fp8: bool) -> dict:
    rows, heads, dim, topk, dev = sh.rows, sh.heads, sh.dim, sh.topk, _device()
    num_keys = context // 4
    row: dict = {"context": context, "keys": num_keys}
    flops = 2 * rows * heads * dim * num_keys
    row["flop_limit_ms"] = flops / (NOMINAL_TFLOPS * 1e9)
    q, k, w, kv_end = _indexer_inputs(sh, num_keys, context, integer=True, seed=1)
    peak, (scores, idx) = _peak_above(partial(K.indexer_topk, q, k, w, kv_end, topk, tiles=tiles))
    row["peak_mib"] = peak
    need = K.indexer_topk_workspace_bytes(rows, heads, dim, num_keys, topk, tiles=tiles)
    row["workspace_mib"] = need / MIB
    ws = torch.empty(need, dtype=torch.uint8, device=dev)
    out_s = torch.empty(rows, topk, device=dev)
    out_i = torch.empty(rows, topk, device=dev, dtype=torch.int32)
    call = partial(K.indexer_topk, out_indices=out_i, out_scores=out_s, workspace=ws, tiles=tiles)
    row["ms_int"] = timer(partial(call, q, k, w, kv_end, topk), 300)
    if check:
        ref_s, ref_i = K.indexer_topk_ref(q, k, w, kv_end, topk, row_block=sh.ref_row_block)
        row["indices_identical"] = bool(torch.equal(ref_i, idx))
        row["scores_identical"] = bool(torch.equal(ref_s, scores))
    q, k, w, kv_end = _indexer_inputs(sh, num_keys, context, integer=False, seed=2)
    row["ms_randn"] = timer(partial(call, q, k, w, kv_end, topk), 300)
    if check:
        call(q, k, w, kv_end, topk)
        ref_s, ref_i = K.indexer_topk_ref(q, k, w, kv_end, topk, row_block=sh.ref_row_block)
        fin = torch.isfinite(ref_s)
        row["randn_max_score_diff"] = float((ref_s[fin] - out_s[fin]).abs().max())
        row["randn_index_agreement"] = float((ref_i == out_i).float().mean())
    row["tflops"] = flops / (row["ms_randn"] * 1e9)
    row["pct_of_limit"] = 100 * row["flop_limit_ms"] / row["ms_randn"]
    if fp8:
        row |= _fp8_figures(sh, context, call, timer, check, out_i)
    if naive:
        try:
            npeak, _ = _peak_above(partial(K.indexer_topk_naive, q, k, w, kv_end, topk))
            row["naive_peak_mib"] = npeak
            t0 = time.perf_counter()
            for _ in range(3):
                K.indexer_topk_naive(q, k, w, kv_end, topk)
            _sync()
            row["naive_ms"] = (time.perf_counter() - t0) / 3 * 1e3
        except torch.cuda.OutOfMemoryError:
            row["naive"] = "out of memory"
    return row


def bench_indexer(sh: BenchShapes, tiles: K.IndexerTiles, timer: Timer, check: bool, naive: bool,
                  fp8: bool) -> list[dict]:
    out = []
    for context in sh.contexts:
        out.append(_indexer_row(sh, context, tiles, timer, check, naive, fp8))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(json.dumps(out[-1]), flush=True)
    return out


def sweep_indexer_tiles(sh: BenchShapes, timer: Timer) -> list[dict]:
    num_keys = sh.sweep_context // 4
    q, k, w, kv_end = _indexer_inputs(sh, num_keys, sh.sweep_context, integer=False, seed=3)
    flops = 2 * sh.rows * sh.heads * sh.dim * num_keys
    out = []
    for tiles in sh.index_candidates:
        try:
            ms = timer(partial(K.indexer_topk, q, k, w, kv_end, sh.topk, tiles=tiles), 200)
        except Exception as exc:  # a configuration that does not compile is reported
            out.append({**asdict(tiles), "error": type(exc).__name__ + ": " + str(exc)[:200]})
            continue
        out.append({**asdict(tiles), "ms": ms, "tflops": flops / (ms * 1e9)})
        print(json.dumps(out[-1]), flush=True)
    return out


def bench_indexer_split(sh: BenchShapes, tiles: K.IndexerTiles, timer: Timer) -> dict:
    """Time of the scoring kernel alone vs the whole call (where the time goes)."""
    from kernels import _indexer_triton as it

    num_keys = sh.sweep_context // 4
    q, k, w, kv_end = _indexer_inputs(sh, num_keys, sh.sweep_context, integer=False, seed=4)
    width = min(tiles.tile_w, num_keys)
    scores = torch.empty(sh.rows, width, device=q.device)

    def scores_only() -> None:
        for col0 in range(0, num_keys, width):
            it.launch_indexer_scores(
                it.IndexerOperands(q, k, w, kv_end), scores=scores,
                col0=col0, n_cols=min(width, num_keys - col0), block_m=tiles.block_m,
                block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            )

    total = timer(partial(K.indexer_topk, q, k, w, kv_end, sh.topk, tiles=tiles), 200)
    part = timer(scores_only, 200)
    return {"context": sh.sweep_context, "total_ms": total, "scores_ms": part,
            "merge_ms": total - part}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_sparse(sh: BenchShapes, timer: Timer, check: bool, copy_tb_s: float) -> list[dict]:
    out, dev = [], _device()
    heads, dim, window, topk = sh.sparse_heads, sh.sparse_dim, sh.window, sh.sparse_topk
    for num_rows, context in sh.sparse_cases:
        g = _gen(5)
        num_comp = context // 4
        q = torch.randn(num_rows, heads, dim, device=dev, generator=g).to(torch.bfloat16)
        comp = torch.randn(num_comp, dim, device=dev, generator=g).to(torch.bfloat16)
        # flat window buffer: the previous window-1 tokens then the chunk's tokens
        win = torch.randn(num_rows + window - 1, dim, device=dev, generator=g).to(torch.bfloat16)
        t = torch.arange(num_rows, device=dev, dtype=torch.int32)
        w_start, w_end = t, t + window
        idx = torch.randint(0, num_comp, (num_rows, topk), device=dev, generator=g,
                            dtype=torch.int32)
        sinks = torch.randn(heads, device=dev, generator=g)
        res = torch.empty_like(q)
        call = partial(K.sparse_attention, q, win, w_start, w_end, scale=dim**-0.5, out=res,
                       compressed_kv=comp, indices=idx, sinks=sinks)
        timed = {tiles: timer(partial(call, tiles=tiles), 150) for tiles in sh.sparse_candidates}
        best = min(timed, key=timed.__getitem__)
        ms = timed[best]
        call(tiles=best)
        splits = {}
        if num_rows < 1024:  # few rows: try splitting each row's entries over programs
            for n in sh.sparse_splits:
                ws = torch.empty(K.sparse_attention_workspace_bytes(num_rows, heads, dim, n),
                                 dtype=torch.uint8, device=dev)
                splits[n] = timer(partial(call, tiles=best, num_splits=n, workspace=ws), 150)
        entries = window + topk
        flops = 4 * num_rows * heads * dim * entries
        moved = num_rows * entries * dim * 2 + 2 * q.numel() * 2  # gathers + q + out
        row = {"rows": num_rows, "context": context, "entries_per_row": entries, "ms": ms,
               "tflops": flops / (ms * 1e9), "flop_limit_ms": flops / (NOMINAL_TFLOPS * 1e9),
               "gather_gb_s": moved / (ms * 1e6), "bytes_limit_ms": moved / (copy_tb_s * 1e9),
               "tiles(h,n,warps,stages)": f"{best.max_block_h},{best.block_n},{best.num_warps},"
                                          f"{best.num_stages}",
               "ms_per_tiles": {f"{t.max_block_h},{t.block_n},{t.num_warps},{t.num_stages}":
                                round(v, 4) for t, v in timed.items()},
               "ms_per_splits": {n: round(v, 4) for n, v in splits.items()} or None}
        if splits:
            best_split = min(splits, key=splits.__getitem__)
            ws = torch.empty(K.sparse_attention_workspace_bytes(num_rows, heads, dim, best_split),
                             dtype=torch.uint8, device=dev)
            call(tiles=best, num_splits=best_split, workspace=ws)  # check the split path too
        if check:
            n = min(num_rows, sh.check_rows)
            ref = K.sparse_attention_ref(q[:n], win, w_start[:n], w_end[:n], scale=dim**-0.5,
                                       compressed_kv=comp, indices=idx[:n], sinks=sinks)
            row["rel_err_vs_ref"] = _rel(res[:n], ref)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _paged_setup(sh: BenchShapes, num_seqs: int, context: int, q_len: int):
    (hq, hkv), dim, bs, dev = sh.paged_heads, sh.paged_dim, sh.block_size, _device()
    g = _gen(6)
    blocks_per = -(-context // bs)
    num_blocks = num_seqs * blocks_per + 1
    kc = torch.randn(num_blocks, bs, hkv, dim, device=dev, generator=g).to(torch.bfloat16)
    vc = torch.randn(num_blocks, bs, hkv, dim, device=dev, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks - 1, device=dev, generator=g) + 1
    bt = perm[: num_seqs * blocks_per].view(num_seqs, blocks_per).to(torch.int32)
    ctx = torch.full((num_seqs,), context, device=dev, dtype=torch.int32)
    qsl = torch.arange(num_seqs + 1, device=dev, dtype=torch.int32) * q_len
    q = torch.randn(num_seqs * q_len, hq, dim, device=dev, generator=g).to(torch.bfloat16)
    return q, kc, vc, bt, qsl, ctx


def bench_paged(sh: BenchShapes, timer: Timer, check: bool, copy_tb_s: float) -> list[dict]:
    out = []
    (hq, hkv), dim = sh.paged_heads, sh.paged_dim
    scale = dim**-0.5
    for q_len, context in sh.prefill_cases:
        q, kc, vc, bt, qsl, ctx = _paged_setup(sh, 1, context, q_len)
        res = torch.empty_like(q)
        call = partial(K.paged_attention, q, kc, vc, bt, qsl, ctx, scale, res)
        timed = {t: timer(partial(call, tiles=t), 150) for t in sh.paged_candidates}
        best = min(timed, key=timed.__getitem__)
        ms = timed[best]
        call(tiles=best)
        visible = sum(context - q_len + i + 1 for i in range(q_len))
        flops = 4 * hq * dim * visible
        row = {"kind": "prefill", "q_len": q_len, "context": context, "ms": ms,
               "tflops": flops / (ms * 1e9), "flop_limit_ms": flops / (NOMINAL_TFLOPS * 1e9),
               "tiles(m,n,warps,stages)": f"{best.block_m},{best.block_n},{best.num_warps},"
                                          f"{best.num_stages}",
               "ms_per_tiles": {f"{t.block_m},{t.block_n},{t.num_warps},{t.num_stages}":
                                round(v, 4) for t, v in timed.items()}}
        if check and q_len * context <= 512 * 8192:
            row["rel_err_vs_ref"] = _rel(res, K.paged_attention_ref(q, kc, vc, bt, qsl, ctx, scale))
        out.append(row)
        print(json.dumps(row), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() \
        else 4
    for num_seqs, context in sh.decode_cases:
        q, kc, vc, bt, qsl, ctx = _paged_setup(sh, num_seqs, context, 1)
        res = torch.empty_like(q)
        splits = K.default_decode_splits(num_seqs, hkv, context, sms)
        ws = torch.empty(max(K.paged_decode_workspace_bytes(num_seqs, hq, dim, splits), 1),
                         dtype=torch.uint8, device=q.device)
        ms = timer(partial(K.paged_decode_attention, q, kc, vc, bt, ctx, scale, res,
                           num_splits=splits, workspace=ws), 200)
        kv_bytes = 2 * num_seqs * context * hkv * dim * 2
        row = {"kind": "decode", "batch": num_seqs, "context": context, "splits": splits,
               "ms": ms, "gb_s": kv_bytes / (ms * 1e6),
               "bytes_limit_ms": kv_bytes / (copy_tb_s * 1e9)}
        if check:
            n = min(num_seqs, 4)
            ref = K.paged_attention_ref(q[:n], kc, vc, bt[:n], qsl[: n + 1], ctx[:n], scale)
            row["rel_err_vs_ref"] = _rel(res[:n], ref)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out
