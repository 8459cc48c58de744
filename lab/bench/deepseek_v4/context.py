"""Context sweep of a DeepSeek-V4 stack at V4-Flash's real layer dimensions (synthetic weights):
chunked prefill from 0 to ``--context`` tokens, per chunk the planned and the measured peak,
device allocations after warm-up and tokens/s; then the same with the naive indexer.

    python -m lab.bench.deepseek_v4.context run --out results.json      # on the GPU
    python -m lab.bench.deepseek_v4.context report results.json         # anywhere

``report`` writes the plot into lab/results (deepseek_v4_context.png) and the table into a section
of docs/deepseek_v4.md between markers. Never used by the engine itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.deepseek_v4 import DeepseekV4KVPool, deepseek_v4_cache_bytes
from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.memory.sizing import (
    deepseek_v4_step_peak_bytes,
    deepseek_v4_step_scratch_bytes,
    deepseek_v4_workspace_bytes,
)
from engine.models.deepseek_v4.model import DeepseekV4Model

_TYPES = {"S": SLIDING, "C": CSA, "H": HCA}
_MARK_BEGIN = "<!-- bench_context:begin -->"
_MARK_END = "<!-- bench_context:end -->"


def flash_config(layers: str, experts: int, context: int, tiny: bool = False) -> DeepseekV4Config:
    """DeepSeek-V4-Flash's per-layer dimensions with ``layers`` (e.g. "SCH") and ``experts``
    (``tiny``: the same structure at toy sizes, for a CPU smoke test of this script)."""
    types = [_TYPES[c] for c in layers]
    if tiny:
        return DeepseekV4Config.from_hf_dict({
            "vocab_size": 101, "hidden_size": 32, "moe_intermediate_size": 16,
            "num_hidden_layers": len(types), "num_attention_heads": 4, "head_dim": 16,
            "q_lora_rank": 16, "qk_rope_head_dim": 8, "num_experts_per_tok": min(2, experts),
            "n_routed_experts": experts, "max_position_embeddings": context,
            "layer_types": types, "mlp_layer_types": ["hash_moe"] + ["moe"] * (len(types) - 1),
            "hc_mult": 2, "sliding_window": 8, "o_groups": 2, "o_lora_rank": 8,
            "index_n_heads": 4, "index_head_dim": 8, "index_topk": 4,
            "compress_rates": {CSA: 4, HCA: 16},
        })
    return DeepseekV4Config.from_hf_dict({
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": len(types), "num_attention_heads": 64, "head_dim": 512,
        "q_lora_rank": 1024, "qk_rope_head_dim": 64, "num_experts_per_tok": min(6, experts),
        "n_routed_experts": experts, "max_position_embeddings": max(context, 1048576),
        "layer_types": types, "mlp_layer_types": ["hash_moe"] + ["moe"] * (len(types) - 1),
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "sliding_window": 128, "o_groups": 8,
        "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    })


@torch.no_grad()
def random_init_(model: DeepseekV4Model, seed: int) -> None:
    """Synthetic weights with the init transformers uses (normal 0.02; norms 1; biases 0)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("scale"):
            p.fill_(1.0)
        elif name.endswith(("base", "position_bias", "sinks")):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    cfg = model.cfg
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            r = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen, device=b.device)
            b.copy_(r.argsort(dim=1)[:, : cfg.num_experts_per_tok])
        elif name.endswith("e_score_correction_bias"):
            b.zero_()


@dataclass(frozen=True)
class ChunkRow:
    context_end: int
    seconds: float
    tokens_per_s: float
    peak_bytes: int
    planned_bytes: int
    device_allocs: int  # cudaMalloc calls during this chunk


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    cfg = flash_config(args.layers, args.experts, args.context, tiny=args.tiny)
    backend = V4Backend(indexer=args.indexer, attention=args.attention)
    kind = backend.resolved(dev)
    model = DeepseekV4Model.empty(cfg, torch.bfloat16, dev, backend)
    random_init_(model, seed=0)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    cache = DeepseekV4KVPool.for_slots(cfg, 1, args.context, torch.bfloat16, dev)
    scratch = deepseek_v4_step_scratch_bytes(
        cfg, args.chunk, args.context, 1, torch.bfloat16,
        backend="kernels" if kind.indexer == "kernels" else "torch",
    )
    ws = None
    if kind.indexer == "kernels":
        from engine.workspace import Workspace

        ws = Workspace(deepseek_v4_workspace_bytes(cfg, args.chunk, args.context), dev)
        ws.lock()
    logits = torch.empty(1, cfg.vocab_size, dtype=torch.bfloat16, device=dev)
    planned = _planned(weights, sum(deepseek_v4_cache_bytes(cfg, 1, args.context).values()),
                       logits.numel() * 2, scratch)
    _sync(cuda)
    base = torch.cuda.memory_allocated() if cuda else 0
    gen = torch.Generator(device=dev).manual_seed(1)
    rows: list[ChunkRow] = []
    result: dict[str, Any] = {
        "indexer": kind.indexer, "attention": kind.attention, "layers": args.layers,
        "experts": args.experts, "chunk": args.chunk, "context": args.context,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "weights_bytes": weights, "cache_bytes": cache.nbytes(), "scratch_plan": scratch,
        "logits_bytes": logits.numel() * 2,
        "planned_bytes": planned, "baseline_allocated": base, "rows": [], "stopped": None,
    }
    if args.check_tokens:
        result["backend_agreement"] = backend_agreement(model, cfg, args.check_tokens)
        print(f"[{kind.indexer}] agreement with torch backend: {result['backend_agreement']}", flush=True)
    t_start = time.time()
    deadline = args.naive_deadline if kind.indexer == "naive" else args.deadline
    for start in range(0, args.context, args.chunk):
        if time.time() - t_start > deadline:
            result["stopped"] = f"deadline at context {start}"
            break
        n = min(args.chunk, args.context - start)
        ids = torch.randint(0, cfg.vocab_size, (n,), device=dev, generator=gen)
        pos = torch.arange(start, start + n, device=dev)
        _sync(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        allocs0 = _device_allocs(cuda)
        t0 = time.perf_counter()
        try:
            h = model(ids, pos, [0, n], [0], cache, ws=ws)
            model.compute_logits(h[-1:], out=logits)
            _sync(cuda)
        except torch.OutOfMemoryError as e:
            result["stopped"] = f"out of memory at context {start + n}: {str(e).splitlines()[0]}"
            break
        dt = time.perf_counter() - t0
        del h
        rows.append(ChunkRow(
            start + n, dt, n / dt, torch.cuda.max_memory_allocated() if cuda else 0, planned,
            _device_allocs(cuda) - allocs0,
        ))
        if len(rows) % args.print_every == 0 or start + n >= args.context:
            r = rows[-1]
            print(f"[{kind.indexer}] ctx {r.context_end:>8} {r.seconds * 1e3:8.1f} ms "
                  f"{r.tokens_per_s:9.0f} tok/s peak {r.peak_bytes / 2**30:6.2f} GiB "
                  f"planned {planned / 2**30:6.2f} GiB allocs {r.device_allocs}", flush=True)
        if start + n >= args.naive_stop and kind.indexer == "naive":
            result["stopped"] = f"naive run stopped by --naive-stop at context {start + n}"
            break
    result["rows"] = [asdict(r) for r in rows]
    warm = rows[args.warmup :]
    result["device_allocs_after_warmup"] = sum(r.device_allocs for r in warm)
    result["max_peak_over_planned"] = max((r.peak_bytes / planned for r in rows), default=0.0)
    return result


def _planned(weights: int, cache: int, logits: int, scratch: dict[str, int]) -> int:
    """Planned device bytes: weights + the cache extent + the logits row + the step's peak."""
    return weights + cache + logits + deepseek_v4_step_peak_bytes(scratch)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _device_allocs(cuda: bool) -> int:
    """cudaMalloc calls so far (segments allocated, where this torch lacks the counter)."""
    if not cuda:
        return 0
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_device_alloc", stats["segment.all.allocated"]))


@torch.no_grad()
def backend_agreement(model: DeepseekV4Model, cfg: DeepseekV4Config, tokens: int) -> dict[str, float]:
    """Prefill the same ``tokens`` with the model's backend and with the plain torch backend;
    relative difference of the final hidden states (a sanity check of the kernels in use)."""
    dev = next(model.parameters()).device
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=dev, generator=torch.Generator(dev).manual_seed(7))
    pos = torch.arange(tokens, device=dev)
    outs = []
    for backend in (model.backend, V4Backend("torch", "torch")):
        saved, model.backend = model.backend, backend
        cache = DeepseekV4KVPool.for_slots(cfg, 1, tokens, torch.bfloat16, dev)
        outs.append(model(ids, pos, [0, tokens], [0], cache).float())
        model.backend = saved
    diff = (outs[0] - outs[1]).norm() / outs[1].norm()
    return {"tokens": tokens, "relative_l2_diff": float(diff)}


def _cmd_run(args: argparse.Namespace) -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    results = []
    for indexer in args.indexers.split(","):
        args.indexer = indexer
        res = run_sweep(args)
        results.append(res)
        out.write_text(json.dumps(results, indent=1))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for path in args.results for r in json.loads(Path(path).read_text())]
    for res in results:  # re-plan from the stored parts, so every report uses today's sizing
        res["planned_bytes"] = _planned(res["weights_bytes"], res["cache_bytes"],
                                        res.get("logits_bytes", 0), res["scratch_plan"])
        for row in res["rows"]:
            row["planned_bytes"] = res["planned_bytes"]
        if res["rows"]:
            res["max_peak_over_planned"] = max(r["peak_bytes"] for r in res["rows"]) / res["planned_bytes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = []
    for res in results:
        rows = res["rows"]
        ctx = [r["context_end"] for r in rows]
        label = f"indexer={res['indexer']}"
        ax1.plot(ctx, [r["peak_bytes"] / 2**30 for r in rows], label=f"measured peak, {label}")
        ax2.plot(ctx, [r["tokens_per_s"] for r in rows], label=label)
        if res["indexer"] != "naive":
            ax1.plot(ctx, [res["planned_bytes"] / 2**30] * len(ctx), "--", label=f"planned, {label}")
        lines.append(_section(res))
    ax1.set_xlabel("context after chunk (tokens)")
    ax1.set_ylabel("GiB allocated (peak within the chunk)")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("context after chunk (tokens)")
    ax2.set_ylabel("prefill tokens / s")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    png = results_dir(Path(args.docs)) / "deepseek_v4_context.png"
    fig.savefig(png, dpi=110)
    link = os.path.relpath(png, args.docs)
    write_marked_section(Path(args.docs) / "deepseek_v4.md", _MARK_BEGIN, _MARK_END,
                         "\n".join([f"![peak and throughput per chunk]({link})", "", *lines]))
    return 0


def results_dir(docs: Path) -> Path:
    """Where a report's plot goes: the lab's results folder beside ``docs`` (lab/results for
    the repository's docs/), made if missing."""
    out = docs.resolve().parent / "lab" / "results"
    out.mkdir(parents=True, exist_ok=True)
    return out


def add_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``report RESULTS [--docs DIR]`` subcommand that report_results() serves."""
    rep = sub.add_parser("report", help="write the section of docs/deepseek_v4.md")
    rep.add_argument("results")
    rep.add_argument("--docs", default="docs")


def run_or_report(p: argparse.ArgumentParser,
                  sub: argparse._SubParsersAction[argparse.ArgumentParser], argv: list[str] | None,
                  run: Callable[[argparse.Namespace], int],
                  report: Callable[[argparse.Namespace], int]) -> int:
    """Add the ``report`` subcommand, parse ``argv`` and run the chosen command."""
    add_report_parser(sub)
    args = p.parse_args(argv)
    return report(args) if args.cmd == "report" else run(args)


def report_results(args: argparse.Namespace, begin: str, end: str,
                   render: Callable[[dict[str, Any]], str], heading: str) -> int:
    """A benchmark's ``report`` command: its results JSON (``args.results``) rendered into
    docs/deepseek_v4.md between its own markers."""
    res = json.loads(Path(args.results).read_text())
    write_marked_section(Path(args.docs) / "deepseek_v4.md", begin, end, render(res),
                         heading=heading)
    return 0


def write_marked_section(md_path: Path, begin: str, end: str, body: str,
                         heading: str = "") -> None:
    """Put ``body`` between the ``begin``/``end`` marker lines of ``md_path`` (the text outside
    them is kept); where the markers are missing, append ``heading`` and a marked section."""
    block = f"{begin}\n{body.rstrip(chr(10))}\n{end}"
    text = md_path.read_text() if md_path.exists() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text + (f"\n{heading}\n" if heading else "") + "\n" + block + "\n"
    md_path.write_text(text)


def _section(res: dict[str, Any]) -> str:
    rows = res["rows"]
    gib = 2**30
    head = (
        f"### indexer `{res['indexer']}`, attention `{res['attention']}` — layers {res['layers']}, "
        f"{res['experts']} experts, chunks of {res['chunk']} ({res['device']}, torch {res['torch']})\n\n"
        f"weights {res['weights_bytes'] / gib:.2f} GiB, cache extent {res['cache_bytes'] / gib:.2f} GiB, "
        f"planned peak {res['planned_bytes'] / gib:.2f} GiB; device allocations after warm-up: "
        f"**{res.get('device_allocs_after_warmup')}**; max measured/planned "
        f"{res.get('max_peak_over_planned', 0):.3f}; stopped: {res['stopped'] or 'no'}\n"
    )
    step = max(1, len(rows) // 24)
    pick = rows[::step] + ([rows[-1]] if rows and rows[-1] is not rows[::step][-1] else [])
    table = ["| context | ms | tokens/s | measured peak GiB | planned GiB | device allocs |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in pick:
        table.append(
            f"| {r['context_end']:,} | {r['seconds'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r['peak_bytes'] / gib:.2f} | {r['planned_bytes'] / gib:.2f} | {r['device_allocs']} |"
        )
    return head + "\n" + "\n".join(table) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.context")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="bench_context.json")
    r.add_argument("--context", type=int, default=1048576)
    r.add_argument("--chunk", type=int, default=4096)
    r.add_argument("--layers", default="SCH")
    r.add_argument("--experts", type=int, default=8)
    r.add_argument("--indexers", default="kernels,naive")
    r.add_argument("--attention", default="auto")
    r.add_argument("--deadline", type=float, default=240.0, help="seconds for a tiled sweep")
    r.add_argument("--naive-deadline", type=float, default=90.0, help="seconds for the naive sweep")
    r.add_argument("--device", default="cuda")
    r.add_argument("--check-tokens", type=int, default=0, help="compare with the torch backend first")
    r.add_argument("--tiny", action="store_true", help="toy dimensions (CPU smoke test)")
    r.add_argument("--naive-stop", type=int, default=1 << 62)
    r.add_argument("--warmup", type=int, default=2, help="chunks before allocations must stop")
    r.add_argument("--print-every", type=int, default=16)
    rep = sub.add_parser("report")
    rep.add_argument("results", nargs="+")
    rep.add_argument("--docs", default="docs")
    args = p.parse_args(argv)
    return _cmd_run(args) if args.cmd == "run" else _cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
