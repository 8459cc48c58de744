"""Resumed-conversation benchmark of a DeepSeek-V4 stack at V4-Flash's layer dimensions
(synthetic weights), for the incident's three shapes (cached prefix + new tokens).

    python -m lab.bench.deepseek_v4.resume resume --out resume.json   # on the GPU
    python -m lab.bench.deepseek_v4.resume report resume.json         # anywhere

One cache slot at ``--context`` (by default the largest cached+new rounded up to a chunk), a locked
Workspace and the planned bytes as in :mod:`.context`. Warm-up first: the plan's worst
steps against a slot pretend-filled to the longest context, as the engine's warm-up does; then
the device-allocation baseline. Per shape: reset the slot, prefill the cached prefix from 0 (turn
N; timed apart, not the resume), then prefill the new tokens in chunks that start at the cached
length and take the last token's logits (the resume: timed, peak per chunk, device allocations).
The shapes run ``--passes`` times (default 2) and the last pass is reported: the first meets each
new chunk length once, and Triton compiles its kernels for it then (its times are kept beside).
``--check`` (last pass) then prefills cached+new again from 0 and compares the last logits.

What it measures: the compute and memory of the resume step on one slot whose state equals the
cached prefix, i.e. what a worker runs that holds the prefix or has loaded it. It does not load
the prefix from LMCache: state rows for 200k tokens are not practical yet (docs/deepseek_v4.md).
``report`` writes a section of docs/deepseek_v4.md between markers. Never used by the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.models.deepseek_v4 import DeepseekV4KVPool, deepseek_v4_cache_bytes
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.models.deepseek_v4.memory.sizing import (
    deepseek_v4_step_scratch_bytes,
    deepseek_v4_workspace_bytes,
)
from engine.models.deepseek_v4.model import DeepseekV4Model
from lab.bench.deepseek_v4.context import (
    _device_allocs,
    _planned,
    _sync,
    flash_config,
    random_init_,
    report_results,
    run_or_report,
)

INCIDENT_SHAPES = "149760+6459,212992+42557,208896+216"
TINY_SHAPES = "40+7,52+21,50+1"
_MARK_BEGIN = "<!-- bench_resume:begin -->"
_MARK_END = "<!-- bench_resume:end -->"
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_SLOT = 0


@dataclass(frozen=True)
class Shape:
    cached: int
    new: int

    @property
    def total(self) -> int:
        return self.cached + self.new


def parse_shapes(text: str) -> list[Shape]:
    """"149760+6459,208896+216" -> [Shape(149760, 6459), Shape(208896, 216)]."""
    shapes = []
    for part in text.split(","):
        cached, _, new = part.strip().partition("+")
        shape = Shape(int(cached), int(new or 0))
        if shape.cached < 0 or shape.new < 1:
            raise ValueError(f"shape {part!r}: need cached >= 0 and new >= 1")
        shapes.append(shape)
    return shapes


def default_context(shapes: list[Shape], chunk: int) -> int:
    """Smallest multiple of ``chunk`` that holds the largest shape."""
    return math.ceil(max(s.total for s in shapes) / chunk) * chunk


@dataclass
class Phase:
    """One run of consecutive chunks of one slot."""

    tokens: int = 0
    seconds: float = 0.0
    max_peak_bytes: int = 0
    device_allocs: int = 0
    chunks: list[dict[str, float]] = field(default_factory=list)  # start, tokens, ms, peak_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ResumeBench:
    """The model, one slot of cache state at ``context``, the workspace and the planned bytes."""

    def __init__(self, args: argparse.Namespace, cfg: DeepseekV4Config | None = None) -> None:
        """``cfg``: replaces the ``flash_config`` of ``args`` (tests)."""
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.chunk = args.chunk
        self.context = args.context
        dtype = _DTYPES[args.dtype]
        self.cfg = cfg or flash_config(args.layers, args.experts, args.context, tiny=args.tiny)
        backend = V4Backend(indexer=args.indexer, attention=args.attention)
        self.kind = backend.resolved(self.dev)
        self.model = DeepseekV4Model.empty(self.cfg, dtype, self.dev, backend)
        random_init_(self.model, seed=0)
        self.weights_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        self.cache = DeepseekV4KVPool.for_slots(self.cfg, 1, args.context, dtype, self.dev)
        self.scratch = deepseek_v4_step_scratch_bytes(
            self.cfg, args.chunk, args.context, 1, dtype,
            backend="kernels" if self.kind.indexer == "kernels" else "torch",
        )
        self.ws = None
        if self.kind.indexer == "kernels":
            from engine.workspace import Workspace

            self.ws = Workspace(deepseek_v4_workspace_bytes(self.cfg, args.chunk, args.context), self.dev)
            self.ws.lock()
        self.logits = torch.empty(1, self.cfg.vocab_size, dtype=dtype, device=self.dev)
        self.cache_bytes = sum(deepseek_v4_cache_bytes(self.cfg, 1, args.context, dtype).values())
        self.planned = _planned(self.weights_bytes, self.cache_bytes,
                                self.logits.numel() * self.logits.element_size(), self.scratch)

    def tokens(self, total: int, seed: int) -> torch.Tensor:
        """Token ids on the host (each chunk is copied to the device when it runs)."""
        return torch.randint(0, self.cfg.vocab_size, (total,), generator=torch.Generator().manual_seed(seed))

    def prefill(self, ids: torch.Tensor, start: int, logits: bool) -> Phase:
        """Feed ``ids`` (host) to the slot, which holds ``start`` tokens, in chunks whose
        boundaries are ``start + k * chunk``; with ``logits``, the last token's logits go into
        ``self.logits`` within the last chunk's time."""
        assert self.cache.num_tokens[_SLOT] == start
        phase = Phase()
        allocs0 = _device_allocs(self.cuda)
        for a in range(0, ids.numel(), self.chunk):
            b = min(a + self.chunk, ids.numel())
            _sync(self.cuda)
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            step_ids = ids[a:b].to(self.dev)
            pos = torch.arange(start + a, start + b, device=self.dev)
            h = self.model(step_ids, pos, [0, b - a], [_SLOT], self.cache, ws=self.ws)
            if logits and b == ids.numel():
                self.model.compute_logits(h[-1:], out=self.logits)
            _sync(self.cuda)
            dt = time.perf_counter() - t0
            del h
            peak = torch.cuda.max_memory_allocated() if self.cuda else 0
            phase.tokens += b - a
            phase.seconds += dt
            phase.max_peak_bytes = max(phase.max_peak_bytes, peak)
            phase.chunks.append({"start": start + a, "tokens": b - a, "ms": dt * 1e3, "peak_bytes": peak})
        phase.device_allocs = _device_allocs(self.cuda) - allocs0
        return phase

    def warmup(self, mode: str) -> dict[str, Any]:
        """The plan's worst steps against a pretend-filled slot (its tensors' contents do not
        change the step's memory): one chunk at [context - chunk, context) and, in ``engine``
        mode, a one-token step at the last position (the engine's decode warm-up for one slot)."""
        steps = [(self.context - self.chunk, self.chunk)]
        if mode == "engine":
            steps.append((self.context - 1, 1))
        gen = torch.Generator().manual_seed(99)
        t0 = time.perf_counter()
        peak = 0
        done = []
        for start, n in steps:
            self.cache.pretend_filled(_SLOT, start)
            ph = self.prefill(torch.randint(0, self.cfg.vocab_size, (n,), generator=gen), start, logits=True)
            peak = max(peak, ph.max_peak_bytes)
            done.append({"start": start, "tokens": n, "seconds": ph.seconds})
        self.cache.reset_slot(_SLOT)
        return {
            "fill": "pretend_filled (slot marked as holding the tokens; no prefill)",
            "steps": done,
            "seconds": time.perf_counter() - t0, "peak_bytes": peak,
        }


def run_shape(bench: ResumeBench, shape: Shape, seed: int, check: bool) -> dict[str, Any]:
    """Turn N (cached prefix from 0), then the resume (new tokens from the cached length)."""
    ids = bench.tokens(shape.total, seed)
    row: dict[str, Any] = {"cached": shape.cached, "new": shape.new, "error": None}
    allocs0 = _device_allocs(bench.cuda)
    bench.cache.reset_slot(_SLOT)
    cached = bench.prefill(ids[: shape.cached], 0, logits=False)
    resume = bench.prefill(ids[shape.cached :], shape.cached, logits=True)
    row.update(
        cached_prefill_s=cached.seconds, cached_tokens_per_s=cached.tokens_per_s,
        cached_max_peak_bytes=cached.max_peak_bytes, cached_device_allocs=cached.device_allocs,
        new_prefill_s=resume.seconds, new_tokens=resume.tokens, new_tokens_per_s=resume.tokens_per_s,
        new_max_peak_bytes=resume.max_peak_bytes, new_device_allocs=resume.device_allocs,
        new_chunks=resume.chunks, planned_bytes=bench.planned,
        peak_over_planned=resume.max_peak_bytes / bench.planned,
        cached_peak_over_planned=cached.max_peak_bytes / bench.planned,
        device_allocs=_device_allocs(bench.cuda) - allocs0,
        last_token_argmax=int(bench.logits.argmax()),
    )
    if check:
        resumed = bench.logits.to("cpu", torch.float32, copy=True)
        bench.cache.reset_slot(_SLOT)
        bench.prefill(ids, 0, logits=True)
        ref = bench.logits.to("cpu", torch.float32, copy=True)
        row["check"] = {
            "max_abs_diff": float((resumed - ref).abs().max()), "max_abs_logit": float(ref.abs().max()),
            "argmax_equal": int(resumed.argmax()) == int(ref.argmax()),
        }
    bench.cache.reset_slot(_SLOT)
    return row


def run_resume(args: argparse.Namespace) -> dict[str, Any]:
    shapes = parse_shapes(args.shapes)
    if args.context is None:
        args.context = default_context(shapes, args.chunk)
    if max(s.total for s in shapes) > args.context or args.chunk > args.context:
        raise SystemExit(f"--context {args.context} is smaller than a shape or the chunk")
    if args.passes < 1:
        raise SystemExit("--passes must be >= 1")
    bench = ResumeBench(args)
    cuda = bench.cuda
    result: dict[str, Any] = {
        "indexer": bench.kind.indexer, "attention": bench.kind.attention, "layers": args.layers,
        "experts": args.experts, "chunk": args.chunk, "context": args.context, "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "weights_bytes": bench.weights_bytes, "cache_bytes": bench.cache_bytes,
        "scratch_plan": bench.scratch, "logits_bytes": bench.logits.numel() * bench.logits.element_size(),
        "planned_bytes": bench.planned, "warmup": None, "shapes": [], "error": None,
    }
    print(f"[resume] {result['device']} indexer={bench.kind.indexer} attention={bench.kind.attention} "
          f"context={args.context} chunk={args.chunk} planned {bench.planned / 2**30:.2f} GiB", flush=True)
    try:
        result["warmup"] = bench.warmup(args.warmup)
    except torch.OutOfMemoryError as e:
        result["error"] = f"out of memory in the warm-up: {str(e).splitlines()[0]}"
        print(f"[resume] {result['error']}", flush=True)
        return result
    _sync(cuda)
    base = _device_allocs(cuda)
    result["warmup"]["device_allocs_baseline"] = base
    print(f"[resume] warm-up {result['warmup']['seconds']:.1f} s, peak "
          f"{result['warmup']['peak_bytes'] / 2**30:.2f} GiB, device allocations so far {base}", flush=True)
    first: list[dict[str, Any]] = []
    for p in range(args.passes):
        last = p == args.passes - 1
        for i, shape in enumerate(shapes):
            try:
                row = run_shape(bench, shape, seed=1 + i, check=args.check and last)
            except torch.OutOfMemoryError as e:
                bench.cache.reset_slot(_SLOT)
                row = {"cached": shape.cached, "new": shape.new,
                       "error": f"out of memory: {str(e).splitlines()[0]}"}
            row["pass"] = p + 1
            print(_line(row), flush=True)
            if p == 0:
                first.append(row)
            if last:
                if p > 0:
                    row["first_pass"] = {k: v for k, v in first[i].items() if k not in ("new_chunks", "check")}
                result["shapes"].append(row)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["device_allocs_after_warmup"] = _device_allocs(cuda) - base
    return result


def _line(row: dict[str, Any]) -> str:
    head = f"[resume] pass {row['pass']} {row['cached']:>7}+{row['new']:<6}"
    if row.get("error"):
        return f"{head} {row['error']}"
    check = row.get("check")
    tail = f" check max|diff| {check['max_abs_diff']:.3g} argmax equal {check['argmax_equal']}" if check else ""
    return (f"{head} new {row['new_prefill_s'] * 1e3:8.1f} ms {row['new_tokens_per_s']:9.0f} tok/s "
            f"peak {row['new_max_peak_bytes'] / 2**30:6.2f} / planned {row['planned_bytes'] / 2**30:6.2f} GiB "
            f"allocs {row['device_allocs']} | cached {row['cached_prefill_s']:.2f} s{tail}")


def _cmd_resume(args: argparse.Namespace) -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.tiny:
        args.shapes = TINY_SHAPES if args.shapes is None else args.shapes
        args.chunk = 8 if args.chunk is None else args.chunk
    args.shapes = INCIDENT_SHAPES if args.shapes is None else args.shapes
    args.chunk = 4096 if args.chunk is None else args.chunk
    result = run_resume(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(report_table(result), flush=True)
    bad = result["error"] or any(r.get("error") for r in result["shapes"])
    return 1 if bad else 0


def report_table(res: dict[str, Any]) -> str:
    """The markdown section for one run."""
    gib = 2**30
    warm = res.get("warmup") or {}
    steps = ", ".join(f"{s['tokens']} at {s['start']:,}" for s in warm.get("steps", []))
    lines = [
        f"indexer `{res['indexer']}`, attention `{res['attention']}`; layers {res['layers']}, "
        f"{res['experts']} experts, {res['dtype']}, chunks of {res['chunk']:,}, one slot of "
        f"{res['context']:,} tokens ({res['device']}, torch {res['torch']}). Weights "
        f"{res['weights_bytes'] / gib:.2f} GiB, cache extent {res['cache_bytes'] / gib:.2f} GiB, planned "
        f"{res['planned_bytes'] / gib:.2f} GiB. Warm-up: {steps or 'not run'} (slot pretend-filled); "
        f"device allocations after it: **{res.get('device_allocs_after_warmup', 'n/a')}**"
        + (f"; error: {res['error']}" if res.get("error") else "") + ".",
        "",
        "| cached | new | resume s | new tokens/s | resume peak GiB | planned GiB | peak/plan | "
        "device allocs (shape) | cached prefill s | cached peak GiB | resume s, pass 1 (allocs) | "
        "last logits vs. prefill from 0 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["shapes"]:
        if r.get("error"):
            lines.append(f"| {r['cached']:,} | {r['new']:,} | {r['error']} ||||||||||")
            continue
        c = r.get("check")
        check = (f"max abs diff {c['max_abs_diff']:.3g} (max abs {c['max_abs_logit']:.3g}), argmax "
                 f"{'equal' if c['argmax_equal'] else 'differs'}") if c else "not checked"
        f1 = r.get("first_pass") or {}
        cold = (f"{f1['new_prefill_s']:.3f} ({f1['device_allocs']})" if "new_prefill_s" in f1
                else f1.get("error") or "-")
        lines.append(
            f"| {r['cached']:,} | {r['new']:,} | {r['new_prefill_s']:.3f} | {r['new_tokens_per_s']:,.0f} | "
            f"{r['new_max_peak_bytes'] / gib:.2f} | {r['planned_bytes'] / gib:.2f} | "
            f"{r['peak_over_planned']:.3f} | {r['device_allocs']} | {r['cached_prefill_s']:.2f} | "
            f"{r['cached_max_peak_bytes'] / gib:.2f} | {cold} | {check} |"
        )
    return "\n".join(lines) + "\n"


def _cmd_report(args: argparse.Namespace) -> int:
    return report_results(args, _MARK_BEGIN, _MARK_END, report_table, "## Resumed conversations (incident shapes)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.resume")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("resume", aliases=["run"], help="measure (GPU; --tiny on CPU)")
    r.add_argument("--out", default="bench_resume.json")
    r.add_argument("--shapes", default=None, help=f"cached+new,... (default {INCIDENT_SHAPES})")
    r.add_argument("--chunk", type=int, default=None, help="tokens per prefill chunk (default 4096)")
    r.add_argument("--context", type=int, default=None,
                   help="slot extent and plan (default: largest cached+new rounded up to a chunk)")
    r.add_argument("--layers", default="SCH")
    r.add_argument("--experts", type=int, default=8)
    r.add_argument("--indexer", default="kernels", choices=["kernels", "torch", "naive", "kernels_ref"])
    r.add_argument("--attention", default="auto")
    r.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    r.add_argument("--device", default="cuda")
    r.add_argument("--warmup", default="engine", choices=["engine", "chunk"],
                   help="engine: worst chunk + one-token step at the last position; chunk: worst chunk only")
    r.add_argument("--passes", type=int, default=2,
                   help="run the shapes this many times; the last is reported, the first's times beside it "
                        "(the first meets each new chunk length once: Triton compiles for it)")
    r.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare the last logits with a prefill of cached+new from 0")
    r.add_argument("--tiny", action="store_true", help=f"toy dimensions (CPU smoke test; shapes {TINY_SHAPES}, chunk 8)")
    return run_or_report(p, sub, argv, _cmd_resume, _cmd_report)


if __name__ == "__main__":
    sys.exit(main())
