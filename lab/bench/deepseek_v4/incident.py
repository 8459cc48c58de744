"""The incident's scenario on a full-depth DeepSeek-V4-Flash shape: one prompt prefilled in chunks
from 0 toward 1,048,576 tokens while other sequences decode, against the memory plan.

    python -m lab.bench.deepseek_v4.incident run --out incident.json      # on the GPU
    python -m lab.bench.deepseek_v4.incident report incident.json         # anywhere (table + PNG)

Weights: V4-Flash's shipped formats built on the device (:mod:`.quantized_weights`; 43 layers x
128 experts by default). The plan is the engine's own (``make_plan`` with the family's terms) for
``max_batch = 1 + decodes`` and a block pool holding the prompt plus the decodes; the context is
the largest multiple of the block size up to ``--target`` whose plan fits the budget ("as far as
the plan allows"). Everything the plan counts is held as the engine holds it: the weights, the
block pool with its slot carry, one Workspace arena of the plan's workspace terms, the per-slot
sampling state; the step's activations are PyTorch's. Each step schedules ``--chunk`` tokens:
the decodes' one token each and the prompt's next ``chunk - decodes`` tokens. Warm-up runs the
plan's worst step (the last chunk against the full context, the decodes at their longest); after
it, every step's cudaMalloc count must stay zero. Per step: seconds, the measured peak of allocated
memory against the plan total, the transient part against the activations term. ``--prompt``
first times a plain prompt (no decodes) from 0 for the prefill figure (``--gemm``: the FP8
activation GEMMs of prefill-sized steps, or the weight-only kernels everywhere), and
``--prompt-previous`` steps of it again with the weight-only GEMMs; ``--previous-steps`` runs
that many incident steps again with the previous path (``--previous gemm``: weight-only GEMMs;
``mhc``: ``V4Backend(mhc="torch")``) at the same contexts, so each gain is a ratio measured in
the same process. Benchmark-only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.memory_plan import MemoryPlan
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.memory.extent import block_multiple
from engine.models.deepseek_v4.memory.kv_pool import DeepseekV4KVPool
from engine.models.deepseek_v4.model import DeepseekV4Model
from engine.models.deepseek_v4.weights.quant_modules import set_prefill_fp8
from engine.workspace import Workspace
from lab.bench.deepseek_v4.context import flash_config
from lab.bench.deepseek_v4.incident_plan import largest_context, plan_for
from lab.bench.deepseek_v4.quantized_weights import (
    synthetic_quantized_state_dict,
)

FLASH_43 = "SS" + "CH" * 20 + "C"  # V4-Flash's 43 layers: two sliding, then CSA/HCA alternating
GiB = 2**30


class Scenario:
    """The model, the pool and the arena of one plan, and the step it runs."""

    def __init__(self, model: DeepseekV4Model, cfg: DeepseekV4Config, plan: MemoryPlan,
                 ec: EngineConfig, per_slot: list[int], decode_context: int) -> None:
        dev = ec.torch_device
        self.model, self.cfg, self.plan, self.dev = model, cfg, plan, dev
        self.pool = DeepseekV4KVPool(cfg, plan.num_blocks, ec.block_size, ec.max_batch,
                                     torch.bfloat16, dev, fp8=ec.kv_dtype == "fp8")
        first, tables = 1, []
        for n in per_slot:
            tables.append(list(range(first, first + n)))
            first += n
        self.pool.static_tables = tables
        self.ws = Workspace(plan.workspace_bytes, dev)
        self.ws.lock()
        self.sampling_state = torch.empty(plan.term("slot_sampling"), dtype=torch.uint8, device=dev)
        self.decodes = ec.max_batch - 1
        self.decode_context = decode_context
        self.gen = torch.Generator(device=dev).manual_seed(1)

    def reset(self, prompt_at: int = 0, with_decodes: bool = True) -> None:
        self.pool.pretend_filled(0, prompt_at)
        for s in range(1, 1 + self.decodes):
            self.pool.pretend_filled(s, self.decode_context if with_decodes else 0)

    def step(self, n: int, with_decodes: bool = True) -> None:
        """The prompt's next ``n`` tokens plus (``with_decodes``) one token per decode slot."""
        d = self.decodes if with_decodes else 0
        start = self.pool.num_tokens[0]
        ids = torch.randint(0, self.cfg.vocab_size, (n + d,), device=self.dev, generator=self.gen)
        dec_pos = [self.pool.num_tokens[s] for s in range(1, 1 + d)]
        pos = torch.tensor(list(range(start, start + n)) + dec_pos, device=self.dev)
        qsl = [0, n] + [n + i + 1 for i in range(d)]
        with self.ws.scope():
            h = self.model(ids, pos, qsl, list(range(1 + d)), self.pool, ws=self.ws)
            rows = torch.tensor([n - 1] + [n + i for i in range(d)], device=self.dev)
            logits = self.ws.take((1 + d, self.cfg.vocab_size), torch.float32,
                                  caller="bench.incident.logits")
            logits.copy_(self.model.compute_logits(h.index_select(0, rows)))
            del h


def _sync() -> None:
    torch.cuda.synchronize()


def _allocs() -> int:
    s = torch.cuda.memory_stats()
    return int(s.get("num_device_alloc", s["segment.all.allocated"]))


def timed_step(sc: Scenario, n: int, with_decodes: bool) -> dict[str, Any]:
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    a0 = _allocs()
    t0 = time.perf_counter()
    sc.step(n, with_decodes)
    _sync()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    return {"context_end": sc.pool.num_tokens[0], "tokens": n, "seconds": dt,
            "decodes": sc.decodes if with_decodes else 0,
            "peak_bytes": peak, "transient_bytes": peak - base, "resident_bytes": base,
            "device_allocs": _allocs() - a0}


def sweep(sc: Scenario, name: str, args: argparse.Namespace, end: int, with_decodes: bool,
          stop_at: float, out: dict[str, Any], max_steps: int | None = None) -> dict[str, Any]:
    """Prefill the prompt from 0 to ``end`` in steps of the chunk budget; rows into ``out``."""
    run: dict[str, Any] = {"name": name, "rows": [], "stopped": None}
    out["runs"].append(run)
    sc.reset(0, with_decodes)
    n_chunk = args.chunk - (sc.decodes if with_decodes else 0)
    while sc.pool.num_tokens[0] < end:
        if time.time() > stop_at:
            run["stopped"] = f"deadline at context {sc.pool.num_tokens[0]:,}"
            break
        if max_steps is not None and len(run["rows"]) >= max_steps:
            run["stopped"] = f"--previous-steps at context {sc.pool.num_tokens[0]:,}"
            break
        try:
            row = timed_step(sc, min(n_chunk, end - sc.pool.num_tokens[0]), with_decodes)
        except torch.OutOfMemoryError as e:
            run["stopped"] = f"out of memory at context {sc.pool.num_tokens[0]:,}: {str(e).splitlines()[0]}"
            break
        run["rows"].append(row)
        k = len(run["rows"])
        if k % args.print_every == 0 or row["context_end"] >= end or k <= 2:
            print(f"[{name}] ctx {row['context_end']:>9,} {row['seconds'] * 1e3:8.1f} ms "
                  f"{row['tokens'] / row['seconds']:7.0f} tok/s peak {row['peak_bytes'] / GiB:7.2f} "
                  f"GiB / plan {out['plan_held_bytes'] / GiB:7.2f} transient "
                  f"{row['transient_bytes'] / GiB:5.2f} / {out['plan_activations_bytes'] / GiB:5.2f} "
                  f"allocs {row['device_allocs']}", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    rows = run["rows"]
    run["device_allocs"] = sum(r["device_allocs"] for r in rows)
    done = sum(r["tokens"] for r in rows)
    run["prompt_tokens"] = done
    run["seconds"] = sum(r["seconds"] for r in rows)
    run["prompt_tokens_per_s"] = done / run["seconds"] if rows else 0.0
    if rows:
        run["max_peak_over_plan"] = max(r["peak_bytes"] for r in rows) / out["plan_held_bytes"]
        run["min_peak_over_plan"] = min(r["peak_bytes"] for r in rows) / out["plan_held_bytes"]
        run["max_transient_over_activations"] = (max(r["transient_bytes"] for r in rows)
                                                 / out["plan_activations_bytes"])
    return run


def _tiles_arg(flag: str, spec: str) -> tuple[int, ...]:
    """'BM,BN,BK,warps,stages[,...]' -> ints, or exit naming the flag."""
    try:
        tiles = tuple(int(t) for t in spec.split(","))
    except ValueError:
        tiles = ()
    if len(tiles) < 5 or min(tiles[:5]) < 1:
        raise SystemExit(f"--{flag.replace('_', '-')} wants BM,BN,BK,warps,stages[,...] as "
                         f"positive integers, got {spec!r}")
    return tiles


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_begin = time.time()
    stop_at = t_begin + args.deadline
    dev = torch.device(args.device)
    cfg = flash_config(args.layers, args.experts, args.target)
    if args.block_size % block_multiple(cfg):
        raise SystemExit(f"--block-size must be a multiple of {block_multiple(cfg)}")
    sd = synthetic_quantized_state_dict(cfg, dev, torch.bfloat16)
    model = DeepseekV4Model.from_state_dict(cfg, sd, torch.bfloat16, dev, V4Backend(), consume=True)
    sd.clear()
    for flag, attr in (("moe_tiles", "prefill_tiles"), ("moe_fp8_tiles", "fp8_tiles")):
        spec = getattr(args, flag)
        if spec:
            tiles = _tiles_arg(flag, spec)
            for mod in model.modules():
                if hasattr(mod, attr):
                    setattr(mod, attr, tiles)
    _sync()
    weights = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if "rotary" not in n)
    device_bytes = torch.cuda.get_device_properties(dev).total_memory
    context = largest_context(cfg, args, weights, device_bytes)
    plan, ec, per_slot = plan_for(cfg, context, args, weights, device_bytes)
    slack = plan.term("allocator_slack")
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "layers": args.layers, "experts": args.experts, "chunk": args.chunk,
        "decodes": args.decodes, "decode_context": args.decode_context,
        "block_size": args.block_size, "kv_dtype": args.kv_dtype, "target": args.target,
        "context": context, "build_s": time.time() - t_begin, "weights_bytes": weights,
        "plan": plan.to_json(), "plan_activations_bytes": plan.term("activations"),
        # what the bench holds of the plan: all but the allocator's cached slack segments
        "plan_held_bytes": plan.total_bytes - slack, "runs": [],
    }
    print(f"[incident] {out['device']}: weights {weights / GiB:.2f} GiB; plan allows context "
          f"{context:,} of {args.target:,} (total {plan.total_bytes / GiB:.2f} GiB of budget "
          f"{plan.budget_bytes / GiB:.2f}; activations {out['plan_activations_bytes'] / GiB:.2f})",
          flush=True)
    sc = Scenario(model, cfg, plan, ec, per_slot, args.decode_context)
    # warm-up: the worst step (last chunk at the full context, decodes at their longest), and a
    # first chunk; allocations are counted from here
    n_chunk = args.chunk - args.decodes
    set_prefill_fp8(model, args.gemm != "weight-only", args.gemm == "fp8")
    for at in (context - n_chunk, 0):
        sc.reset(at)
        for s in range(1, 1 + sc.decodes):
            sc.pool.pretend_filled(s, per_slot[s] * args.block_size - 1)
        sc.step(n_chunk)
    sc.reset(0, with_decodes=False)
    sc.step(min(args.chunk, context))
    if args.gemm != "weight-only" and (args.prompt_previous or (args.previous_steps
                                                                and args.previous == "gemm")):
        set_prefill_fp8(model, False)  # compile the weight-only GEMMs' prefill tiles too
        sc.reset(0, with_decodes=False)
        sc.step(min(args.chunk, context))
        set_prefill_fp8(model, True, args.gemm == "fp8")
    _sync()
    out["warmup_s"] = time.time() - t_begin - out["build_s"]
    out["gemm"] = args.gemm
    if args.prompt:
        sweep(sc, "prompt", args, min(args.prompt, context), False, stop_at, out)
    if args.prompt_previous:  # the same prompt with the weight-only GEMMs: the ratio
        set_prefill_fp8(model, False)
        sweep(sc, "prompt-previous-gemm", args, min(args.prompt, context), False, stop_at, out,
              args.prompt_previous)
        set_prefill_fp8(model, args.gemm != "weight-only", args.gemm == "fp8")
    if args.previous_steps:
        if args.previous == "mhc":
            model.backend = V4Backend(mhc="torch")
        else:
            set_prefill_fp8(model, False)
        out["previous_kind"] = args.previous
        sweep(sc, "previous-path", args, context, True, stop_at, out, args.previous_steps)
        model.backend = V4Backend()
        set_prefill_fp8(model, args.gemm != "weight-only", args.gemm == "fp8")
    sweep(sc, "incident", args, context, True, stop_at, out)
    out["seconds"] = time.time() - t_begin
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.incident")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure (CUDA)")
    r.add_argument("--out", default="incident.json")
    r.add_argument("--layers", default=FLASH_43)
    r.add_argument("--experts", type=int, default=128)
    r.add_argument("--target", type=int, default=1048576, help="context to aim for")
    r.add_argument("--chunk", type=int, default=4096, help="tokens a step (chunk_tokens)")
    r.add_argument("--decodes", type=int, default=4, help="sequences decoding during the prefill")
    r.add_argument("--decode-context", type=int, default=4096)
    r.add_argument("--block-size", type=int, default=512)
    r.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"])
    r.add_argument("--memory-utilization", type=float, default=0.92)
    r.add_argument("--prompt", type=int, default=131072, help="plain prompt timed first (0: skip)")
    r.add_argument("--previous-steps", type=int, default=8)
    r.add_argument("--previous", default="gemm", choices=["gemm", "mhc"],
                   help="what --previous-steps turns back: the weight-only GEMMs or the PyTorch mHC")
    r.add_argument("--gemm", default="fp8-linears", choices=["fp8", "fp8-linears", "weight-only"],
                   help="prefill GEMMs of the main sweeps: FP8 activations (>= 128 rows) in the "
                        "linears and experts, in the linears only (the engine's default), or "
                        "nowhere")
    r.add_argument("--moe-tiles", default="",
                   help="BM,BN,BK,warps,stages[,swap,scaled,words,n-first] of the weight-decoding "
                        "experts at prefill sizes (empty: the kernel's choice)")
    r.add_argument("--moe-fp8-tiles", default="",
                   help="BM,BN,BK,warps,stages of the FP8 experts (empty: the kernel's choice)")
    r.add_argument("--prompt-previous", type=int, default=0,
                   help="steps of the plain prompt again with the weight-only GEMMs (0: none)")
    r.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run")
    r.add_argument("--print-every", type=int, default=16)
    r.add_argument("--device", default="cuda")
    rep = sub.add_parser("report", help="table into docs/deepseek_v4.md and the PNG")
    rep.add_argument("results")
    rep.add_argument("--docs", default="docs")
    args = p.parse_args(argv)
    if args.cmd == "report":
        from lab.bench.deepseek_v4.incident_report import write_report

        return write_report(json.loads(Path(args.results).read_text()), Path(args.docs))
    torch.backends.cuda.matmul.allow_tf32 = True
    res = run(args)
    bad = [r["name"] for r in res["runs"] if r["device_allocs"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
