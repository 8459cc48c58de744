"""Decode benchmark of a DeepSeek-V4 stack at V4-Flash's layer dimensions (synthetic weights),
served through the real engine (LLMEngine: plan, warm-up, scheduler, batched decode, sampler).

    python -m lab.bench.deepseek_v4.decode run --out decode.json   # on the GPU
    python -m lab.bench.deepseek_v4.decode report decode.json      # anywhere

The model is built as in :mod:`.context` (``flash_config`` + ``random_init_``), or with
``--weights fp8-mxfp4`` in V4-Flash's shipped formats (:mod:`.quantized_weights`); its state
dict goes to one ``LLMEngine`` with ``max_batch`` = the largest of ``--batches``, ``max_context``
= ``--context``, strict device allocations on CUDA. The engine's model adopts the tensors (no
copy: they are already in their final dtype on the device). Per batch size and prompt length: B greedy requests with random
prompts; steps run untimed until each has its first token (prefill; early requests decode
meanwhile, so ``max_tokens`` leaves room for those steps), ``--warm-steps`` more untimed, then
``--steps`` decode steps timed, each one token for all B requests. Then the rest are aborted.
``report`` writes a section of docs/deepseek_v4.md between markers. Never used by the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, KernelChoices
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.weights.quant_weights import resident_weight_bytes
from kernels import pdl_launch, pdl_mode
from lab.bench.deepseek_v4.context import (
    _sync,
    flash_config,
    random_init_,
    report_results,
    run_or_report,
)
from lab.bench.deepseek_v4.decode_report import report_table
from lab.bench.deepseek_v4.decode_row import max_tokens_for, run_row
from lab.bench.deepseek_v4.hf_config import hf_dict
from lab.bench.deepseek_v4.previous_kernels import previous_decode_kernels
from lab.bench.deepseek_v4.quantized_weights import (
    active_weight_bytes,
    quantized_hf_config,
    synthetic_quantized_state_dict,
)

# the report heading and the helpers other benchmarks and the tests take from here
__all__ = ["HEADING", "build_engine", "hf_dict", "main", "max_tokens_for", "previous_decode_kernels",
           "run_decode"]

_MARK_BEGIN = "<!-- bench_decode:begin -->"
_MARK_END = "<!-- bench_decode:end -->"
HEADING = "## Decode through the engine"
# --tiny: toy dimensions on CPU (each value applies where its option is not given)
TINY = {"context": 256, "prompts": "20", "steps": 3, "batches": "1,2", "chunk": 16}
FULL = {"context": 16384, "prompts": "1024", "steps": 32, "batches": "1,8,32", "chunk": 4096}
_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def build_engine(args: argparse.Namespace) -> tuple[LLMEngine, dict[str, Any]]:
    """The V4-Flash-shaped model with synthetic weights, handed to an LLMEngine (which plans,
    allocates and warms up); the bench's own copy of the weights is freed afterwards."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    cfg = flash_config(args.layers, args.experts, args.context, tiny=args.tiny)
    ec = EngineConfig(
        model=f"synthetic-v4-flash-{args.layers}-{args.experts}e", device=args.device,
        dtype=_DTYPES[dtype], max_context=args.context, chunk_tokens=args.chunk,
        max_batch=max(args.batch_list), strict_allocations=cuda and getattr(args, "strict", True),
        seed=0, cuda_graphs=not getattr(args, "no_graphs", False),
        block_size=args.block_size or (16 if args.tiny else 256),
        attn_tile_tokens=args.block_size or (16 if args.tiny else 256),
        num_blocks=args.num_blocks, kv_dtype=args.kv_dtype,
        kernels=KernelChoices(decode=getattr(args, "decode", "auto"),
                              lanes=getattr(args, "lanes", 1)),
    )
    t0 = time.perf_counter()
    hf = hf_dict(cfg)
    if args.weights == "fp8-mxfp4":
        # V4-Flash's shipped formats, made on the device and kept as they are by the model
        if args.tiny:  # MXFP4 needs widths in multiples of 32
            cfg = dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32)
            hf = hf_dict(cfg)
        weights = synthetic_quantized_state_dict(cfg, dev, ec.torch_dtype)
        hf = quantized_hf_config(hf)
    else:
        model = DeepseekV4Model.empty(cfg, ec.torch_dtype, dev, V4Backend())
        random_init_(model, seed=0)
        weights = dict(model.state_dict())  # shares the module's storage
        del model
    weights_bytes = resident_weight_bytes(weights, ec.torch_dtype, ec.weight_format)
    # Before the engine: its two 1 GiB buffers are device allocations, which after the warm-up
    # were counted against the engine (the "2 allocations at batch 1's first step" of 12:33).
    copy_tb_s = _copy_tb_s(dev) if cuda else None
    engine = LLMEngine(ec, ModelConfig.from_hf_dict(hf, name=ec.model), weights)
    weights.clear()  # the engine loaded them into its own module: drop ours
    _sync(cuda)
    kind = engine.runner.model.model.backend.resolved(dev)
    v4 = engine.runner.model.model
    active = {b: active_weight_bytes(v4, cfg, b) for b in args.batch_list}
    info = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
        "dtype": dtype, "weights": args.weights, "layers": args.layers, "experts": args.experts, "context": args.context,
        "chunk": args.chunk, "max_batch": ec.max_batch, "indexer": kind.indexer,
        "block_size": ec.block_size, "num_blocks": engine.plan.num_blocks,
        "kv_tokens": engine.plan.kv_tokens, "kv_dtype": ec.kv_dtype,
        "kv_bytes": engine.plan.term("kv_cache"),
        "attention": kind.attention, "decode_path": kind.decode,
        "strict_allocations": ec.strict_allocations,
        "cuda_graphs": engine.runner.graphs is not None,
        "weights_bytes": weights_bytes, "plan_total_bytes": engine.plan.total_bytes,
        "plan_activations_bytes": engine.plan.term("activations"),
        "resident_weight_bytes": sum(t.numel() * t.element_size() for n, t in v4.state_dict().items()
                                     if "rotary" not in n),
        "active_weight_bytes": active, "copy_tb_s": copy_tb_s,
        "warmup": dataclasses.asdict(engine.warmup_report),
        "build_s": time.perf_counter() - t0,
        "weights_copy": "adopted by the engine's model (no second copy)",
    }
    return engine, info


def _copy_tb_s(dev: torch.device) -> float:
    """Device copy bandwidth (read + write) in TB/s: the rate weights can stream at."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize(dev)
    rate = 5 * 2 * src.numel() / (time.perf_counter() - t) / 1e12
    del src, dst
    torch.cuda.empty_cache()  # give the 2 GiB back before the engine plans its memory
    return rate


def _switch_lanes(engine: LLMEngine, lanes: int) -> None:
    """The next pass of ``--lanes 2,1,...`` on the same weights: the model's backend takes the
    other lane count, and the decode graphs are captured again with it (no second build)."""
    v4 = engine.runner.model.model
    v4.backend = dataclasses.replace(v4.backend, lanes=lanes)
    t = time.perf_counter()
    engine.recapture_graphs()
    print(f"[decode] lanes {lanes}: decode graphs captured again in "
          f"{time.perf_counter() - t:.1f} s", flush=True)


def _line(row: dict[str, Any], lanes: bool = False) -> str:
    which = f"lanes={row['lanes']} " if lanes else ""
    head = f"[decode] {which}B={row['batch']:>3} prompt={row['prompt']:>6}"
    if "tokens_per_s" not in row:
        return f"{head} {row['error']}"
    return (f"{head} {row['ms_per_step']:8.2f} ms/step {row['tokens_per_s']:9.1f} tok/s "
            f"(median {row['ms_per_step_median']:.2f} ms) prefill {row['prefill_s']:.2f} s "
            f"allocs since warm-up {row['device_allocs_since_warmup']}"
            + (f" ERROR {row['error']}" if row["error"] else ""))


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, then one row per (batch, prompt); JSON written after each row."""
    t_begin = time.time()
    stop_at = t_begin + args.deadline
    out = Path(args.out) if args.out else None
    result: dict[str, Any] = {"rows": [], "stopped": None, "error": None, "steps": args.steps,
                              "warm_steps": args.warm_steps, "deadline_s": args.deadline}
    try:
        engine, info = build_engine(args)
    except (torch.OutOfMemoryError, EngineError) as e:
        result["error"] = f"engine build failed: {type(e).__name__}: {str(e).splitlines()[0]}"
        print(f"[decode] {result['error']}", flush=True)
        return result
    result.update(info)
    w = info["warmup"]
    peak = w["activation_peak_bytes"]
    print(f"[decode] {info['device']} {info['dtype']} indexer={info['indexer']} "
          f"attention={info['attention']} decode={info['decode_path']} context={args.context} chunk={args.chunk} "
          f"max_batch={info['max_batch']}; built in {info['build_s']:.1f} s; plan "
          f"{info['plan_total_bytes'] / 2**30:.2f} GiB; warm-up activations measured "
          f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'} / planned "
          f"{w['activation_planned_bytes'] / 2**30:.2f} GiB", flush=True)
    lane_list = args.lane_list
    for n_pass, lanes in enumerate(lane_list):
        if n_pass:
            try:
                _switch_lanes(engine, lanes)
            except (torch.OutOfMemoryError, EngineError) as e:
                result["error"] = (f"lanes {lanes}: recapture failed: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0]}")
                print(f"[decode] {result['error']}", flush=True)
                break
        for batch in args.batch_list:
            for prompt in args.prompt_list:
                if time.time() > stop_at:
                    which = f"lanes {lanes} " if len(lane_list) > 1 else ""
                    result["stopped"] = (f"deadline ({args.deadline:.0f} s) before {which}"
                                         f"B={batch} prompt={prompt}")
                    break
                row = run_row(engine, batch, prompt, args, stop_at)
                row["lanes"] = lanes
                if info["copy_tb_s"]:
                    # every active weight byte read once per step at the copy rate
                    row["streaming_limit_tok_s"] = (batch * info["copy_tb_s"] * 1e12
                                                    / info["active_weight_bytes"][batch])
                print(_line(row, len(lane_list) > 1), flush=True)
                result["rows"].append(row)
                if out:
                    out.write_text(json.dumps(result, indent=1))
            if result["stopped"]:
                break
        if result["stopped"]:
            print(f"[decode] stopped: {result['stopped']}", flush=True)
            break
    result["device_allocs_since_warmup"] = engine.stats().device_allocs_since_warmup
    result["seconds"] = time.time() - t_begin
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _cmd_run(args: argparse.Namespace) -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    defaults = TINY if args.tiny else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batch_list, args.prompt_list = _ints(args.batches), _ints(args.prompts)
    args.lane_list = _ints(args.lanes)
    if not args.lane_list or any(n not in (1, 2) for n in args.lane_list):
        raise SystemExit(f"--lanes {args.lanes!r}: each entry must be 1 or 2")
    args.lanes = args.lane_list[0]  # what the engine is built with
    fl = importlib.import_module("kernels.fp8_linear")
    serial = fl.SERIAL_SPLIT_REDUCE
    fl.SERIAL_SPLIT_REDUCE = not args.two_launch_reduce
    pdl_env = os.environ.get("BULKHEAD_PDL")
    if args.no_pdl:  # before the engine's warm-up launches or captures anything
        os.environ["BULKHEAD_PDL"] = "0"
    elif args.pdl is not None:
        os.environ["BULKHEAD_PDL"] = args.pdl
    try:
        mode = pdl_mode()  # raises on a bad BULKHEAD_PDL, before anything is built
        pdl = pdl_launch(torch.device(args.device))
        mode = mode if pdl else 0
        with previous_decode_kernels(args.previous_kernels):
            result = run_decode(args)
    finally:
        fl.SERIAL_SPLIT_REDUCE = serial
        if pdl_env is None:
            os.environ.pop("BULKHEAD_PDL", None)
        else:
            os.environ["BULKHEAD_PDL"] = pdl_env
    result["previous_kernels"] = args.previous_kernels
    result["lanes"] = args.lane_list
    result["two_launch_reduce"] = args.two_launch_reduce
    result["no_pdl"] = args.no_pdl
    result["pdl"] = pdl  # whether the Triton kernels were launched with PDL
    result["pdl_mode"] = mode  # its bits (kernels._triton_support.PDL_*)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(report_table(result), flush=True)
    bad = result["error"] or any(r["error"] for r in result["rows"])
    return 1 if bad else 0


def _cmd_report(args: argparse.Namespace) -> int:
    return report_results(args, _MARK_BEGIN, _MARK_END, report_table, HEADING)


# the run's on/off switches, each against the engine's default path (to compare)
_SWITCHES = (
    ("--no-graphs", "decode eagerly (default: CUDA graphs where the family allows them)"),
    ("--two-launch-reduce", "split-K FP8 GEMVs sum their partials in a second launch (as before) "
                            "instead of in their last slice"),
    ("--previous-kernels", "the fused decode's previous kernel choices (no split-K, tiled "
                           "experts, torch.topk indexer merge), to compare"),
    ("--no-pdl", "launch the Triton kernels without programmatic dependent launch "
                 "(sets BULKHEAD_PDL=0; default: PDL on sm_90+), to compare"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.decode")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (GPU; --tiny on CPU)")
    r.add_argument("--out", default="bench_decode.json")
    r.add_argument("--batches", default=None, help=f"batch sizes (default {FULL['batches']})")
    r.add_argument("--prompts", "--prompt", default=None,
                   help=f"prompt lengths, e.g. 1024,8192 (default {FULL['prompts']})")
    r.add_argument("--steps", type=int, default=None, help=f"timed decode steps (default {FULL['steps']})")
    r.add_argument("--warm-steps", type=int, default=2, help="untimed decode steps before timing")
    r.add_argument("--context", type=int, default=None, help=f"engine max_context (default {FULL['context']})")
    r.add_argument("--chunk", type=int, default=None, help=f"engine chunk_tokens (default {FULL['chunk']})")
    r.add_argument("--layers", default="SCH")
    r.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default 256; 16 with --tiny)")
    r.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool in blocks, shared by all sequences (default: every sequence "
                        "can reach --context)")
    r.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"])
    r.add_argument("--experts", type=int, default=8)
    r.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    r.add_argument("--weights", default="bf16", choices=("bf16", "fp8-mxfp4"),
                   help="bf16: every weight in --dtype, experts looped in Python (the eager path); "
                        "fp8-mxfp4: V4-Flash's shipped formats kept on the device, fused MoE")
    r.add_argument("--device", default="cuda")
    r.add_argument("--decode", default="auto", choices=("auto", "fused", "unfused"),
                   help="the decode step's layer loop: fused row kernels or "
                        "the unfused loop prefill shares (the previous path and the engine's default: auto)")
    for flag, what in _SWITCHES:
        r.add_argument(flag, action="store_true", help=what)
    r.add_argument("--lanes", default="1",
                   help="the fused decode step's streams (2: the side lane, step/decode_step.py); a "
                        "list such as 2,1,2,1 runs every row once per entry on the same weights, "
                        "the decode graphs captured again between entries")
    r.add_argument("--pdl", metavar="MODE",
                   help="BULKHEAD_PDL for the run: 1 (wait only), or 'trigger', 'prefetch', "
                        "'trigger+prefetch' (kernels/NOTES.md), to compare")
    r.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run")
    r.add_argument("--tiny", action="store_true", help=f"toy dimensions (CPU smoke test; {TINY})")
    return run_or_report(p, sub, argv, _cmd_run, _cmd_report)


if __name__ == "__main__":
    sys.exit(main())
