"""Where a DeepSeek-V4 prefill chunk spends its time and memory, at V4-Flash's dimensions with
weights in the shipped formats (FP8 projections, MXFP4 experts; synthetic values).

    python -m lab.bench.deepseek_v4.prefill_profile --layers SCH --experts 128 --out prof.json

Chunked prefill of one sequence (optionally with ``--decodes`` one-token sequences in the same
step) straight through ``DeepseekV4Model``; per chunk the time and the peak above the resident
memory; then one chunk again with hooks that record each part's time and transient peak
(attention, MoE, mHC per layer type) and one under ``torch.profiler`` (top kernels by device
time, top operators by host time). Benchmark-only: the engine never imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool
from engine.models.deepseek_v4.memory.sizing import (
    deepseek_v4_step_peak_bytes,
    deepseek_v4_step_scratch_bytes,
    deepseek_v4_workspace_bytes,
)
from engine.models.deepseek_v4.memory.step_peak import (
    deepseek_v4_kernels_peak_bytes,
    deepseek_v4_kernels_step_bytes,
)
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.workspace import Workspace
from lab.bench.deepseek_v4.context import flash_config
from lab.bench.deepseek_v4.quantized_weights import synthetic_quantized_state_dict


def _cuda() -> bool:
    return torch.cuda.is_available()


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if _cuda() else 0


def _reset_peak() -> None:
    if _cuda():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if _cuda() else 0


def build(args: argparse.Namespace) -> tuple[DeepseekV4Model, Any, DeepseekV4KVPool, Workspace]:
    dev = torch.device(args.device)
    cfg = flash_config(args.layers, args.experts, args.context)
    if args.tiny:  # toy widths that MXFP4 accepts (multiples of 32), for a CPU check of the script
        cfg = dataclasses.replace(flash_config(args.layers, args.experts, args.context, tiny=True),
                                  hidden_size=64, moe_intermediate_size=32)
    sd = synthetic_quantized_state_dict(cfg, dev, torch.bfloat16)
    model = DeepseekV4Model.from_state_dict(cfg, sd, torch.bfloat16, dev, V4Backend(), consume=True)
    sd.clear()
    cache = DeepseekV4KVPool.for_slots(cfg, 1 + args.decodes, args.context, torch.bfloat16, dev)
    ws = Workspace(deepseek_v4_workspace_bytes(cfg, args.chunk + args.decodes, args.context, True), dev)
    ws.lock()
    return model, cfg, cache, ws


def step_inputs(cfg: Any, start: int, n: int, decodes: int, dec_ctx: int,
                gen: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """One prefill chunk [start, start + n) in slot 0 plus ``decodes`` one-token sequences."""
    ids = torch.randint(0, cfg.vocab_size, (n + decodes,), device=dev, generator=gen)
    pos = torch.cat([torch.arange(start, start + n), torch.full((decodes,), dec_ctx)]).to(dev)
    qsl = [0, n] + [n + i + 1 for i in range(decodes)]
    return ids, pos, qsl, list(range(1 + decodes))


def run_chunk(model: DeepseekV4Model, cfg: Any, cache: DeepseekV4KVPool, ws: Workspace,
              start: int, args: argparse.Namespace, gen: torch.Generator) -> None:
    n = min(args.chunk, args.context - start)
    for s in range(1, 1 + args.decodes):
        cache.num_tokens[s] = args.decode_context
    ids, pos, qsl, slots = step_inputs(cfg, start, n, args.decodes, args.decode_context, gen,
                                      torch.device(args.device))
    with ws.scope():
        h = model(ids, pos, qsl, slots, cache, ws=ws)
    del h


def part_hooks(model: DeepseekV4Model, stats: dict[str, list[float]]) -> list[Any]:
    """Per module kind and layer type: seconds and transient peak (bytes above entry)."""
    handles = []
    for layer in model.model.layers:
        lt = layer.self_attn.layer_type[:3]
        for name, mod in (("attention", layer.self_attn), ("moe", layer.mlp),
                          ("attn_hc", layer.attn_hc), ("ffn_hc", layer.ffn_hc)):
            key = f"{name}/{lt}"

            def pre(_m: Any, _a: Any, key: str = key) -> None:
                _sync()
                stats[key + ".base"].append(_allocated())
                _reset_peak()
                stats[key + ".t0"].append(time.perf_counter())

            def post(_m: Any, _a: Any, _o: Any, key: str = key) -> None:
                _sync()
                stats[key + ".s"].append(time.perf_counter() - stats[key + ".t0"][-1])
                stats[key + ".peak"].append(_peak() - stats[key + ".base"][-1])

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.prefill_profile")
    p.add_argument("--layers", default="SCH")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--decodes", type=int, default=0)
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--out", default="prefill_profile.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy dimensions (CPU check of the script)")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    model, cfg, cache, ws = build(args)
    _sync()
    res: dict[str, Any] = {"args": vars(args), "build_s": time.perf_counter() - t0,
                           "device": torch.cuda.get_device_name() if _cuda() else "cpu",
                           "torch": torch.__version__}
    scratch = deepseek_v4_step_scratch_bytes(cfg, args.chunk, args.context, 1 + args.decodes)
    res["plan_scratch"] = scratch
    parts = deepseek_v4_kernels_step_bytes(cfg, args.chunk, args.context, 1 + args.decodes)
    res["plan_kernels_parts"] = parts
    res["plan_step_peak"] = deepseek_v4_kernels_peak_bytes(parts)
    res["plan_step_peak_torch_path"] = deepseek_v4_step_peak_bytes(scratch)
    gen = torch.Generator(device=args.device).manual_seed(1)
    rows = []
    for start in range(0, args.context - args.chunk, args.chunk):
        _sync()
        base = _allocated()
        _reset_peak()
        t = time.perf_counter()
        run_chunk(model, cfg, cache, ws, start, args, gen)
        _sync()
        rows.append({"context_end": start + args.chunk, "s": time.perf_counter() - t,
                     "transient": _peak() - base})
        print(f"ctx {start + args.chunk:>7} {rows[-1]['s'] * 1e3:8.1f} ms "
              f"transient {rows[-1]['transient'] / 2**30:.3f} GiB "
              f"(plan {res['plan_step_peak'] / 2**30:.3f})", flush=True)
    res["rows"] = rows
    last = args.context - args.chunk
    stats: dict[str, list[float]] = defaultdict(list)
    handles = part_hooks(model, stats)
    cache.num_tokens[0] = last
    run_chunk(model, cfg, cache, ws, last, args, gen)
    for h in handles:
        h.remove()
    parts = {k[:-2]: {"s": sum(v), "calls": len(v), "max_peak": max(stats[k[:-2] + ".peak"])}
             for k, v in stats.items() if k.endswith(".s")}
    res["parts"] = parts
    for k, v in sorted(parts.items()):
        print(f"{k:<16} {v['s'] * 1e3:8.1f} ms over {v['calls']} calls, max transient "
              f"{v['max_peak'] / 2**20:8.1f} MiB", flush=True)
    cache.num_tokens[0] = last
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda() else [])
    with profile(activities=acts) as prof:
        run_chunk(model, cfg, cache, ws, last, args, gen)
        _sync()
    ka = prof.key_averages()
    res["top_device"] = ka.table(sort_by="cuda_time_total" if _cuda() else "cpu_time_total", row_limit=30)
    res["top_host"] = ka.table(sort_by="self_cpu_time_total", row_limit=20)
    print(res["top_device"], flush=True)
    print(res["top_host"], flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
