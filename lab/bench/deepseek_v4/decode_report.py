"""The markdown report of one ``lab.bench.deepseek_v4.decode`` run (a JSON result -> a table and a
line of context). Pure formatting: runs nothing, imports no torch."""

from __future__ import annotations

from typing import Any


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def _streaming(res: dict[str, Any]) -> str:
    if not res.get("copy_tb_s"):
        return ""
    active = {int(b): n for b, n in res["active_weight_bytes"].items()}  # JSON keys are strings
    per = ", ".join(f"B={b}: {_gib(n)}" for b, n in sorted(active.items()))
    return (f"; weight bytes a decode step reads at least once, GiB: {per}; copy rate "
            f"{res['copy_tb_s']:.2f} TB/s")


def report_table(res: dict[str, Any]) -> str:
    """The markdown body for one run."""
    if res.get("error"):
        return f"Run failed: {res['error']}\n"
    w = res["warmup"]
    # several passes (--lanes 2,1,...): a column saying which pass each row is of
    passes = res.get("lanes")
    lanes_head = "| lanes " if isinstance(passes, list) and len(passes) > 1 else ""
    lines = [
        f"indexer `{res['indexer']}`, attention `{res['attention']}`, decode "
        f"`{res.get('decode_path', 'unfused')}`; layers {res['layers']}, "
        f"{res['experts']} experts, weights {res.get('weights', 'bf16')}, {res['dtype']}, max_batch {res['max_batch']}, context "
        f"{res['context']:,}, chunks of {res['chunk']:,} ({res['device']}, torch {res['torch']}). "
        f"Weights {_gib(res['weights_bytes'])} GiB (resident {_gib(res.get('resident_weight_bytes'))} GiB"
        f"{_streaming(res)}), plan {_gib(res['plan_total_bytes'])} GiB. "
        f"Warm-up: activations measured {_gib(w['activation_peak_bytes'])} GiB / planned "
        f"{_gib(w['activation_planned_bytes'])} GiB, workspace peak {_gib(w['workspace_peak_bytes'])} "
        f"/ {_gib(w['workspace_capacity_bytes'])} GiB; CUDA graphs "
        f"{'on' if res.get('cuda_graphs') else 'off'}; strict allocations "
        f"{'on' if res['strict_allocations'] else 'off'}; device allocations since warm-up at the "
        f"end: **{res.get('device_allocs_since_warmup')}**. {res['steps']} timed decode steps per "
        f"row after {res['warm_steps']} untimed ones"
        + (f"; stopped: {res['stopped']}" if res.get("stopped") else "") + ".",
        "",
        lanes_head + "| batch | prompt | context at start | ms/step | median ms/step | tokens/s | "
        "weight-streaming limit tok/s | decode peak GiB | device allocs (row) | prefill s (steps; tok/s) | error |",
        ("|---:" if lanes_head else "") + "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        lane = f"| {r.get('lanes')} " if lanes_head else ""
        if "tokens_per_s" not in r:
            lines.append(f"{lane}| {r['batch']} | {r['prompt']:,} | | | | | | | "
                         f"{r.get('device_allocs_row')} | | {r['error']} |")
            continue
        lo, hi = r["context_at_start"]
        lines.append(
            f"{lane}| {r['batch']} | {r['prompt']:,} | {lo:,}-{hi:,} | {r['ms_per_step']:.2f} | "
            f"{r['ms_per_step_median']:.2f} | {r['tokens_per_s']:,.1f} | "
            f"{r.get('streaming_limit_tok_s') or float('nan'):,.0f} | {_gib(r['decode_peak_bytes'])} | "
            f"{r['device_allocs_row']} | {r['prefill_s']:.2f} ({r['prefill_steps']}; "
            f"{r.get('prefill_tokens_per_s', float('nan')):,.0f} tok/s) | {r['error'] or ''} |"
        )
    return "\n".join(lines) + "\n"
