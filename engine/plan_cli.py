"""``bulkhead plan``: print the memory plan for a model and limits without loading weights."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.help_format import DefaultsHelpFormatter
from engine.config import EngineConfig
from engine.config_resolve import resolve_engine_config
from engine.errors import EngineError, PlanError
from engine.memory_planner import GiB, MemoryPlan, make_plan
from engine.model_config import ModelConfig
from engine.models import family_class


def _model_config(path: str) -> ModelConfig:
    p = Path(path)
    if p.suffix == ".json":
        return ModelConfig.from_json_file(p)  # named after its folder
    if p.is_dir() and (p / "config.json").exists():
        return ModelConfig.from_json_file(p / "config.json")
    from engine.checkpoint import load_model_config
    return load_model_config(p)


def _model_label(path: str, mc: ModelConfig) -> str:
    """What the plan is of: the file or folder given (a folder holding config.json by its own
    name, a lone config.json file by its file name, never by the folder it happens to sit in),
    then the checkpoint's own name (``_name_or_path``) or architecture and its family."""
    p = Path(path)
    given = p.name if p.is_dir() or p.name != "config.json" else f"{p.parent.name}/config.json"
    hf = mc.hf_config or {}
    own = hf.get("_name_or_path") or (hf.get("architectures") or [None])[0]
    return f"{given}: {own} ({mc.family})" if own else f"{given} ({mc.family})"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bulkhead plan", description=__doc__,
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="config.json, a checkpoint folder, or a .gguf file (weights not read)")
    ap.add_argument("--max-context", default="auto",
                    help="longest prompt + output, or auto: the longest that fits the planned "
                    "device with max-batch sequences at it, up to the model's limit")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="largest prefill chunk")
    ap.add_argument("--max-batch", type=int, default=8, help="most sequences running at once")
    ap.add_argument("--block-size", type=int, default=0,
                    help="paged KV block size in tokens (0: the model's default, as the workers)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV extent in blocks (None: every sequence can reach max-context)")
    ap.add_argument("--attn-tile-tokens", type=int, default=0,
                    help="keys per attention tile (multiple of block-size; 0: 256 in whole "
                    "blocks)")
    ap.add_argument("--memory-share", type=float, default=1.0,
                    help="this role's share of what the weights leave of the budget (the "
                    "roles of one card with share_weights)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                    help="weights and KV dtype")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"],
                    help="stored KV entries in the model dtype (auto) or FP8 with per-row scales")
    ap.add_argument("--weights-gib", type=float, default=None,
                    help="weight bytes to plan with (default: estimated from the config)")
    ap.add_argument("--weight-format", default="checkpoint", choices=["checkpoint", "dequantize"],
                    help="quantized checkpoints: kept as stored, or dequantized to --dtype")
    ap.add_argument("--device-memory-gib", type=float, default=96.0,
                    help="device memory to plan against (a 96 GB card)")
    ap.add_argument("--memory-utilization", type=float, default=0.92,
                    help="share of device memory the plan may take")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="plan for a CUDA device (Triton attention, decode graphs) or the CPU path")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="plan eager decode steps (the workers' cuda_graphs: false): no graph pool")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="plan one rank of this many devices (--device-memory-gib and "
                    "--weights-gib are then per device)")
    ap.add_argument("--speculative-method", default="none", choices=["none", "ngram", "mtp"],
                    help="plan the verify rows of speculative decoding (mtp is refused)")
    ap.add_argument("--num-speculative-tokens", type=int, default=3,
                    help="draft tokens per sequence and step, with a --speculative-method")
    ap.add_argument("--json", action="store_true", help="print JSON, one entry per term")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        mc = _model_config(args.model)
        if args.max_context != "auto" and not args.max_context.isdigit():
            raise PlanError(f"--max-context {args.max_context!r} is neither auto nor a number")
        ec = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          max_context=0 if args.max_context == "auto" else int(args.max_context),
                          chunk_tokens=args.chunk_tokens, memory_share=args.memory_share,
                          max_batch=args.max_batch, block_size=args.block_size,
                          num_blocks=args.num_blocks, attn_tile_tokens=args.attn_tile_tokens,
                          memory_utilization=args.memory_utilization, kv_dtype=args.kv_dtype,
                          weight_format=args.weight_format,
                          tensor_parallel_size=args.tensor_parallel_size,
                          cuda_graphs=not args.no_cuda_graphs,
                          speculative_method=args.speculative_method,
                          num_speculative_tokens=args.num_speculative_tokens)
        weights = None if args.weights_gib is None else int(args.weights_gib * GiB)
        tp = ec.tensor_parallel_size
        rank_mc = mc if tp == 1 else family_class(mc).rank_model_config(mc, tp)
        memory = int(args.device_memory_gib * GiB)
        ec = resolve_engine_config(ec, mc, lambda c: make_plan(rank_mc, c, memory, weights).fits)
        label = f"planned {args.device_memory_gib:g} GiB device" + (
            f", one of {tp} ranks" if tp > 1 else "")
        plan = make_plan(rank_mc, ec, memory, weights, device_label=label)
    except EngineError as e:
        print(f"bulkhead plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": _model_label(args.model, mc), "family": mc.family,
                          **plan.to_json()}, indent=2))
    else:
        print(f"model {_model_label(args.model, mc)}, dtype {args.dtype}, max_context "
              f"{ec.max_context}, chunk {ec.chunk_tokens}, max_batch {ec.max_batch}, block_size "
              f"{ec.block_size}, kv_dtype {ec.kv_dtype}")
        print(plan.table())
        if ec.tensor_parallel_size > 1:
            print(_per_rank(plan, ec.tensor_parallel_size))
        if not plan.fits:
            print("\nDOES NOT FIT: " + str(_safe_check(plan)))
    return 0 if plan.fits else 1


def _per_rank(plan: MemoryPlan, tp: int) -> str:
    """The figures an operator compares with a peer's start-up log, one rank of ``tp``."""
    return (f"per rank (each of {tp}): weights {plan.term('weights') / GiB:.2f} GiB, KV "
            f"{plan.term('kv_cache') / GiB:.2f} GiB = {plan.kv_tokens:,} tokens, workspace "
            f"{plan.workspace_bytes / GiB:.2f} GiB, activations "
            f"{plan.term('activations') / GiB:.2f} GiB, communication "
            f"{(plan.term('tp.allreduce_staging') + plan.term('tp.nccl_buffers')) / GiB:.2f} GiB")


def _safe_check(plan) -> str:
    try:
        plan.check()
    except EngineError as e:
        return str(e)
    return ""


if __name__ == "__main__":
    sys.exit(main())
