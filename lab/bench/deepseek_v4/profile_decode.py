"""Profile of DeepSeek-V4 decode steps through the engine (GPU): the top operations by CUDA and
by CPU time, kernel launches, graph launches and host syncs per step, and (``--trace-allocs``)
every device allocation made after the warm-up with the frames of ours that asked for it.

    python -m lab.bench.deepseek_v4.profile_decode --weights fp8-mxfp4 --layers SCHC --experts 8 \
        --batch 8 --prompt 1024 --steps 5 [--no-graphs] [--decode unfused] [--trace-allocs] \
        --out prof.txt

The device kernels are also grouped by family (per step and per layer); with ``--no-graphs``
one more eager step counts the PyTorch ops that launch work by the function of ours that
called them (:mod:`.kernel_sources`).

The model and engine are built as by :mod:`.decode` (same options). Prints and writes a text
report. Never used by the engine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from engine.sampling_params import SamplingParams
from lab.bench.deepseek_v4.decode import _DTYPES, build_engine
from lab.bench.deepseek_v4.kernel_sources import OpSources, family_table
from lab.bench.deepseek_v4.previous_kernels import previous_decode_kernels

# runtime API calls counted per step; the synchronising ones are what stalls the host
_COUNTED = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
            "cudaMemcpy", "cudaEventSynchronize")


def _alloc_report(snapshot: dict) -> list[str]:
    lines = []
    for trace in snapshot.get("device_traces", []):
        for ev in trace:
            if ev["action"] in ("segment_alloc", "segment_map"):
                frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                          for f in ev.get("frames", [])
                          if any(k in f["filename"] for k in ("/engine/", "/kernels/", "/bench/"))]
                lines.append(f"{ev['action']} {ev['size']:,} B: {' <- '.join(frames[:8])}")
    return lines


def profile(args: argparse.Namespace) -> str:
    engine, info = build_engine(args)
    out = [f"[profile] layers {args.layers} experts {args.experts} weights {args.weights} batch "
           f"{args.batch} prompt {args.prompt} graphs {info['cuda_graphs']} lanes {args.lanes} "
           f"build {info['build_s']:.1f} s"]
    if args.trace_allocs:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=args.prompt + 64, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", torch.randint(0, engine.model_config.vocab_size, (args.prompt,),
                                                  generator=gen).tolist(), sp)
    steps = 0
    while any(s.is_prefill for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
        steps += 1
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    counts = Counter({e.key: e.count for e in events if e.key in _COUNTED})
    out.append(f"[profile] {dt * 1e3:.2f} ms/step over {args.steps} profiled steps (profiler on); "
               f"per step: " + ", ".join(f"{k} {v / args.steps:.0f}" for k, v in sorted(counts.items())))
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    out.append(f"[profile] device kernels per step: {kernels / args.steps:.0f}")
    num_layers = len(args.layers)
    out.append(f"[profile] device kernels by family ({num_layers} layers):")
    out.append(family_table(events, args.steps, num_layers))
    if args.no_graphs:
        sources = OpSources()
        with sources:
            engine.step()
        torch.cuda.synchronize()
        out.append(f"[profile] one eager step, PyTorch ops by source ({num_layers} layers):")
        out.append(sources.table(num_layers))
    sort_cuda = "cuda_time_total" if hasattr(events[0], "cuda_time_total") else "device_time_total"
    out.append(events.table(sort_by=sort_cuda, row_limit=args.rows, max_name_column_width=60))
    out.append(events.table(sort_by="self_cpu_time_total", row_limit=args.rows,
                            max_name_column_width=60))
    out.append(f"[profile] device allocations since warm-up: {engine.stats().device_allocs_since_warmup}")
    if args.trace_allocs:
        out += _alloc_report(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.profile_decode")
    p.add_argument("--layers", default="SCHC")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--weights", default="fp8-mxfp4", choices=("bf16", "fp8-mxfp4"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--rows", type=int, default=25, help="rows of each table")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--decode", default="auto", choices=("auto", "fused", "unfused"))
    p.add_argument("--lanes", type=int, default=1, choices=(1, 2),
                   help="the fused decode step's streams (2: the side lane, step/decode_step.py)")
    p.add_argument("--trace-allocs", action="store_true")
    p.add_argument("--previous-kernels", action="store_true",
                   help="the fused decode's previous kernel choices (see lab.bench.deepseek_v4.decode)")
    p.add_argument("--out", default="profile_decode.txt")
    args = p.parse_args(argv)
    args.device, args.dtype, args.tiny, args.batch_list = "cuda", None, False, [args.batch]
    args.block_size = args.num_blocks = None
    args.kv_dtype, args.strict = "auto", False
    assert args.dtype is None or args.dtype in _DTYPES
    with previous_decode_kernels(args.previous_kernels):
        text = profile(args)
    print(text, flush=True)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
