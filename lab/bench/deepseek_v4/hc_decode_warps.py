"""The mHC work of a decode step's block boundary (``kernels.hc_decode``: mix, finish with its
Sinkhorn, norm) at V4-Flash's shape (4 streams x 4096, 20 Sinkhorn rounds), at each warps
choice given, timed from a CUDA graph (the launches as a captured decode step makes them) and
checked against the default's outputs.

    python -m lab.bench.deepseek_v4.hc_decode_warps --batches 1,8,32 --warps "4,4,2;4,1,2;2,1,1"

Warps: mix,finish,norm. Without a GPU it runs each choice once through the Triton interpreter
on a tiny shape (a smoke test).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lab.bench.results_file import write_json


def _warps(spec: str) -> tuple[int, int, int]:
    w = tuple(int(t) for t in spec.split(","))
    if len(w) != 3:
        raise argparse.ArgumentTypeError(f"--warps: mix,finish,norm, got {spec!r}")
    return w  # type: ignore[return-value]


def _graph_us(fn, calls: int = 20, reps: int = 20) -> float:
    """Microseconds a call of ``fn`` replayed ``calls`` times back to back from one graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    samples.sort()
    return samples[len(samples) // 2]


def sweep(batches: list[int], choices: list[tuple[int, int, int]], dev: str, streams: int = 4,
          hidden: int = 4096, iters: int = 20) -> list[dict[str, Any]]:
    from kernels._hc_decode_triton import hc_decode_warps
    from kernels.hc_decode import hc_decode, hc_decode_partial_shape

    rows = (2 + streams) * streams
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    out = []
    for n in batches:
        g = torch.Generator(device=dev).manual_seed(n)
        f32 = dict(device=dev, dtype=torch.float32)
        s = torch.randn(n, streams, hidden, device=dev, generator=g).to(dt)
        fn = torch.randn(rows, streams * hidden, device=dev, generator=g) * 0.01
        base, scale = torch.randn(rows, **f32) * 0.1, torch.ones(3, **f32)
        norm_w = torch.rand(hidden, **f32) + 0.5
        p0, c0 = torch.rand(n, streams, **f32), torch.rand(n, streams, streams, **f32)
        bo = torch.randn(n, hidden, device=dev, generator=g).to(dt)
        ref = None
        default = hc_decode_warps(n)
        for w in [default, *[c for c in choices if c != default]]:
            bufs = dict(partial=torch.empty(hc_decode_partial_shape(n, streams, hidden), **f32),
                        x=torch.empty(n, hidden, device=dev, dtype=dt),
                        post=torch.empty(n, streams, **f32),
                        comb=torch.empty(n, streams, streams, **f32),
                        merged=torch.empty_like(s))

            args = (s, fn, base, scale, norm_w, iters, 1e-6, 1e-6)

            def call(w=w, bufs=bufs, args=args, merge=(p0, c0, bo)):
                hc_decode(*args, merge=merge, warps=w, **bufs)

            call()
            got = (bufs["x"].float(), bufs["post"], bufs["comb"], bufs["merged"].float())
            diff = 0.0 if ref is None else max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True))
            ref = ref or got
            us = _graph_us(call) if dev == "cuda" else float("nan")
            row = dict(batch=n, warps=list(w), us=us, max_diff=diff)
            out.append(row)
            print(f"[hc_decode] batch {n:3d} warps mix,finish,norm {w}: {us:7.2f} us "
                  f"max diff {diff:.1e}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.hc_decode_warps",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--warps", default="4,4,2;4,1,2;4,2,2;2,1,1;1,1,1")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    try:
        choices = [_warps(c) for c in a.warps.split(";") if c.strip()]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        p.error(str(exc))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw: dict[str, Any] = {} if dev == "cuda" else dict(hidden=128, iters=3)
    batches = [int(b) for b in a.batches.split(",")] if dev == "cuda" else [1]
    rows = sweep(batches, choices, dev, **kw)
    write_json(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
