"""Measurement cases for the quantized GEMMs behind ``python -m lab.bench.kernels --only quant``:
the block-scaled FP8 linear and the fused MXFP4 experts at DeepSeek-V4-Flash shapes, each
against the time to stream its weight bytes once (decode is bandwidth-bound) and checked
against its reference. Measurement code only: the engine must never import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from kernels.fp8_linear import fp8_linear
from kernels.fp8_linear_ref import fp8_linear_ref
from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes
from kernels.mxfp4_moe_ref import moe_experts_ref

Timer = Callable[[Callable[[], object], int], float]


def graph_ms(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Device milliseconds of one ``fn`` replayed from a CUDA graph with L2 flushed before
    each call: host launch overhead (tens of microseconds a launch) no longer hides a decode
    kernel's own time, and a weight that would fit in L2 is still streamed from HBM, as in a
    server whose layers take turns. Two graphs, (flush, fn) x n and flush x n; the difference
    over n. NaN without a GPU."""
    if not torch.cuda.is_available():
        return float("nan")
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    n = 20
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
        graphs = []
        for with_fn in (True, False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(n):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(graph)
    torch.cuda.synchronize()
    times = []
    for graph in graphs:
        samples = []
        for _ in range(max(3, rep_ms // 10)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        times.append(sorted(samples)[len(samples) // 2])
    return (times[0] - times[1]) / n


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _random_fp8(n: int, k: int, dev: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite e4m3 only: a cast of anything past +-448 gives the NaN code, which would make
    the error column NaN (the kernel keeps NaN codes NaN, as the reference does)."""
    q = (torch.randn(n, k, device=dev, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), device=dev, generator=g) * 1e-3
    return q, s


def _random_mxfp4(e: int, n: int, k: int, dev: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (e, n, k // 2), device=dev, generator=g, dtype=torch.uint8)
    scale = torch.randint(118, 122, (e, n, k // 32), device=dev, generator=g, dtype=torch.uint8)
    return packed, scale


def bench_quant(timer: Timer, copy_tb_s: float, smoke: bool, check: bool) -> list[dict]:
    """Rows: fp8 linear (V4-Flash's q_b 1024 -> 32768 and a 4096 x 4096 projection) at 1, 32
    and 4096 rows; MXFP4 experts (128 experts, hidden 4096, intermediate 2048, top-6) at 1, 8,
    32 and 4096 tokens."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    out: list[dict] = []
    lin_shapes = ((96, 40),) if smoke else ((32768, 1024), (4096, 4096))
    rows_list = (1, 5) if smoke else (1, 32, 4096)
    for n, k in lin_shapes:
        q, s = _random_fp8(n, k, dev, g)
        for m in rows_list:
            x = torch.randn(m, k, device=dev, generator=g).to(dt)
            y = torch.empty(m, n, device=dev, dtype=dt)
            ms = timer(lambda x=x, y=y, q=q, s=s: fp8_linear(x, q, s, y), 100)
            wbytes = q.numel() + s.numel() * 4
            gms = graph_ms(lambda x=x, y=y, q=q, s=s: fp8_linear(x, q, s, y))
            row = {"case": "fp8_linear", "m": m, "n": n, "k": k, "ms": ms, "graph_ms": gms,
                   "tflops": 2 * m * n * k / (min(ms, gms) * 1e9),
                   "weight_stream_ms": wbytes / (copy_tb_s * 1e9)}
            if check:
                row["rel_err_vs_ref"] = _rel(y, fp8_linear_ref(x.float(), q, s))
            out.append(row)
            print(json.dumps(row), flush=True)
    e, hid, inter, top_k = (6, 64, 32, 2) if smoke else (128, 4096, 2048, 6)
    gu, gus = _random_mxfp4(e, 2 * inter, hid, dev, g)
    dn, dns = _random_mxfp4(e, hid, inter, dev, g)
    expert_bytes = (gu[0].numel() + gus[0].numel() + dn[0].numel() + dns[0].numel())
    for t in ((1, 3) if smoke else (1, 8, 32, 4096)):
        x = torch.randn(t, hid, device=dev, generator=g).to(dt)
        ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:top_k] for _ in range(t)])
        w = torch.rand(t, top_k, device=dev, generator=g)
        y = torch.empty(t, hid, device=dev, dtype=dt)
        ws = torch.empty(moe_experts_workspace_bytes(t, top_k, hid, inter, e, dt),
                         dtype=torch.uint8, device=dev)
        ms = timer(lambda x=x, ids=ids, w=w, y=y, ws=ws: moe_experts(
            x, w, ids, gu, gus, dn, dns, 10.0, y, workspace=ws), 100)
        gms = graph_ms(lambda x=x, ids=ids, w=w, y=y, ws=ws: moe_experts(
            x, w, ids, gu, gus, dn, dns, 10.0, y, workspace=ws))
        touched = int(ids.unique().numel())
        row = {"case": "mxfp4_moe", "tokens": t, "experts": e, "top_k": top_k,
               "experts_touched": touched, "ms": ms, "graph_ms": gms,
               "tflops": 2 * t * top_k * 3 * hid * inter / (min(ms, gms) * 1e9),
               "weight_stream_ms": touched * expert_bytes / (copy_tb_s * 1e9)}
        if check and t <= 32:
            row["rel_err_vs_ref"] = _rel(y, moe_experts_ref(x.float(), w, ids, gu, gus, dn, dns, 10.0))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def sweep_quant_tiles(timer: Timer = graph_ms, parts: tuple[str, ...] = ("moe", "fp8"),
                      fp8_tiles: tuple[tuple[int, int, int, int], ...] = (),
                      moe_decode: tuple[tuple[int, ...], ...] = (),
                      moe_prefill: tuple[tuple[int, ...], ...] = ()) -> list[dict]:
    """Tile choices of the decode FP8 kernel and of the MoE GEMMs at the bench shapes, each
    timed: how the defaults in ``fp8_gemv_tiles`` and ``moe_tiles`` were picked (GPU only).
    The decode variants (split-K, the no-dot GEMV) are swept by ``lab.bench.quant_decode_sweep``."""
    from kernels._fp8_linear_triton import launch_fp8_gemv
    from kernels._mxfp4_moe_triton import launch_moe, launch_moe_sort

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []
    for n, k in ((4096, 4096), (32768, 1024)) if "fp8" in parts else ():
        q, s = _random_fp8(n, k, dev, g)
        for m in (1, 32):
            x = torch.randn(m, 1, k, device=dev, generator=g).to(dt)
            y = torch.empty(m, 1, n, device=dev, dtype=dt)
            for bn, unroll, warps, stages in fp8_tiles:
                tiles = (16 if m <= 16 else 32, bn, 128, unroll, warps, stages)
                ms = timer(lambda x=x, y=y, q=q, s=s, t=tiles: launch_fp8_gemv(
                    x, q.view(torch.uint8), s, y, (128, 128), t), 20)
                rows.append({"case": "fp8_gemv", "m": m, "n": n, "k": k, "tiles": tiles,
                             "ms": ms, "gb_s": (q.numel() + s.numel() * 4) / (ms * 1e6)})
                print(json.dumps(rows[-1]), flush=True)
    if "moe" not in parts:
        return rows
    e, hid, inter, top_k = 128, 4096, 2048, 6
    gu, gus = _random_mxfp4(e, 2 * inter, hid, dev, g)
    dn, dns = _random_mxfp4(e, hid, inter, dev, g)
    for t, choices in ((1, moe_decode), (8, moe_decode), (32, moe_decode), (4096, moe_prefill)):
        if not choices:
            continue
        x = torch.randn(t, hid, device=dev, generator=g).to(dt)
        ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:top_k] for _ in range(t)])
        w = torch.rand(t, top_k, device=dev, generator=g)
        m = t * top_k
        order = torch.empty(m, dtype=torch.int64, device=dev)
        row_end = torch.empty(e, dtype=torch.int32, device=dev)
        h = torch.empty(m, inter, dtype=dt, device=dev)
        yy = torch.empty(m, hid, dtype=dt, device=dev)
        out = torch.empty(t, hid, dtype=dt, device=dev)
        sort_ms = timer(lambda ids=ids, order=order, row_end=row_end: launch_moe_sort(
            ids.view(-1), order, row_end, e), 20)
        rows.append({"case": "moe_sort", "tokens": t, "ms": sort_ms})
        print(json.dumps(rows[-1]), flush=True)
        for tiles in choices:
            ms = timer(lambda x=x, ids=ids, w=w, tiles=tiles, order=order, row_end=row_end,
                       h=h, yy=yy, out=out: launch_moe(
                x, ids.view(-1), order, row_end, w.view(-1), gu, gus, dn, dns, 10.0, h, yy, out,
                top_k, False, tiles), 20)
            rows.append({"case": "mxfp4_moe", "tokens": t, "tiles": tiles, "ms": ms,
                         "tflops": 2 * m * 3 * hid * inter / (ms * 1e9)})
            print(json.dumps(rows[-1]), flush=True)
    return rows
