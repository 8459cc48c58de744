"""Report of :mod:`.incident`: a plot (lab/results/deepseek_v4_incident.png) of the measured peak of
every step against the plan and of prefill tokens/s against context, and a table between
markers in docs/deepseek_v4.md. Reads the results JSON only; never measures anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.bench.deepseek_v4.context import results_dir, write_marked_section

BEGIN, END = "<!-- bench_incident:begin -->", "<!-- bench_incident:end -->"
HEADING = "## The incident's scenario at full depth"
PNG = "deepseek_v4_incident.png"
PNG_LINK = f"../lab/results/{PNG}"  # from docs/deepseek_v4.md
GiB = 2**30


def replan(res: dict[str, Any]) -> dict[str, Any]:
    """The results with the plan made again by today's formulas for the same scenario (the
    measurements stay as recorded): ratios and the table then show today's plan."""
    import argparse

    from lab.bench.deepseek_v4.context import flash_config
    from lab.bench.deepseek_v4.incident_plan import plan_for

    args = argparse.Namespace(
        decode_context=res["decode_context"], chunk=res["chunk"], decodes=res["decodes"],
        block_size=res["block_size"], device="cuda", kv_dtype=res["kv_dtype"],
        memory_utilization=res["plan"]["memory_utilization"], target=res["target"])
    cfg = flash_config(res["layers"], res["experts"], res["target"])
    plan, _, _ = plan_for(cfg, res["context"], args, res["weights_bytes"],
                          res["plan"]["device_memory_bytes"])
    out = dict(res, plan=plan.to_json(), plan_activations_bytes=plan.term("activations"),
               plan_held_bytes=plan.total_bytes - plan.term("allocator_slack"),
               recorded_plan_held_bytes=res["plan_held_bytes"],
               recorded_plan_activations_bytes=res["plan_activations_bytes"], runs=[])
    from engine.models.deepseek_v4.memory.step_peak import (
        deepseek_v4_kernels_peak_bytes,
        deepseek_v4_kernels_step_bytes,
    )

    for run in res["runs"]:
        rows = [dict(r) for r in run["rows"]]
        for i, r in enumerate(rows):  # the formula at the tokens this step's sequences hold
            held = r["context_end"] + r["decodes"] * (res["decode_context"] + i + 1)
            parts = deepseek_v4_kernels_step_bytes(cfg, res["chunk"], res["context"],
                                                   1 + res["decodes"], kv_tokens=held,
                                                   kv_fp8=res["kv_dtype"] == "fp8")
            r["formula_here_bytes"] = deepseek_v4_kernels_peak_bytes(parts)
        new = dict(run, rows=rows)
        if rows:
            new["max_peak_over_plan"] = max(r["peak_bytes"] for r in rows) / out["plan_held_bytes"]
            new["min_peak_over_plan"] = min(r["peak_bytes"] for r in rows) / out["plan_held_bytes"]
            new["max_transient_over_activations"] = (max(r["transient_bytes"] for r in rows)
                                                     / out["plan_activations_bytes"])
            here = [r["transient_bytes"] / r["formula_here_bytes"] for r in rows]
            new["transient_over_formula_here"] = (min(here), max(here))
        out["runs"].append(new)
    return out


def _run(res: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in res["runs"] if r["name"] == name), None)


def ratio_at_same_contexts(res: dict[str, Any], prev_name: str = "previous-path",
                           new_name: str = "incident") -> float | None:
    """Previous path's seconds over the new path's, over the steps both ran (same contexts)."""
    prev, new = _run(res, prev_name), _run(res, new_name)
    if not prev or not new or not prev["rows"] or not new["rows"]:
        return None
    k = min(len(prev["rows"]), len(new["rows"]))
    # the first step of a sweep compiles nothing (warm-up did) but starts from an empty prompt
    return (sum(r["seconds"] for r in prev["rows"][:k])
            / sum(r["seconds"] for r in new["rows"][:k]))


def plot(res: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    plan = res["plan_held_bytes"] / GiB
    for run in res["runs"]:
        ctx = [r["context_end"] for r in run["rows"]]
        ax1.plot(ctx, [r["peak_bytes"] / GiB for r in run["rows"]], ".-", ms=3,
                 label=f"measured peak, {run['name']}")
        ax2.plot(ctx, [r["tokens"] / r["seconds"] for r in run["rows"]], ".-", ms=3,
                 label=run["name"])
    end = max((r["context_end"] for run in res["runs"] for r in run["rows"]), default=1)
    ax1.axhline(plan, ls="--", c="k", label=f"plan ({plan:.2f} GiB)")
    ax1.axhline(0.9 * plan, ls=":", c="gray", label="90% of the plan")
    ax1.set_xlim(0, end)
    ax1.set_xlabel("prompt tokens in the cache after the step")
    ax1.set_ylabel("GiB allocated (peak within the step)")
    ax1.legend(fontsize=8)
    ax1.set_title(f"{len(res['layers'])} layers x {res['experts']} experts, plan for "
                  f"{res['context']:,} tokens", fontsize=9)
    ax2.set_xlabel("prompt tokens in the cache after the step")
    ax2.set_ylabel("prompt tokens / s")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def render(res: dict[str, Any]) -> str:
    plan = res["plan"]
    lines = [
        f"![peak per step against the plan, and prefill rate]({PNG_LINK})", "",
        f"{res['device']}, torch {res['torch']}; {len(res['layers'])} layers x {res['experts']} "
        f"experts, FP8/MXFP4 weights {res['weights_bytes'] / GiB:.2f} GiB; chunk budget "
        f"{res['chunk']} tokens a step with {res['decodes']} sequences decoding (from "
        f"{res['decode_context']:,} tokens); blocks of {res['block_size']}, KV {res['kv_dtype']}. "
        f"The plan allows {res['context']:,} of {res['target']:,} tokens: "
        f"{plan['total_bytes'] / GiB:.2f} GiB of a {plan['budget_bytes'] / GiB:.2f} GiB budget, "
        f"activations {res['plan_activations_bytes'] / GiB:.2f} GiB; the bench holds "
        f"{res['plan_held_bytes'] / GiB:.2f} GiB of it (all but the allocator slack).", "",
    ]
    if res.get("recorded_plan_activations_bytes", res["plan_activations_bytes"]) != res["plan_activations_bytes"]:
        lines += [f"(The plan above is made by today's formulas; the run printed its ratios against "
                  f"the formulas of its own commit: activations "
                  f"{res['recorded_plan_activations_bytes'] / GiB:.3f} GiB, held "
                  f"{res['recorded_plan_held_bytes'] / GiB:.2f} GiB.)", ""]
    lines += [
        "| run | steps | prompt tokens | tok/s | last context | stopped | device allocs after "
        "warm-up | peak / plan (min-max) | transient / activations (max) | transient / "
        "formula at the step's own context (min-max) |",
        "|---|---:|---:|---:|---:|---|---:|---|---:|---|",
    ]
    for run in res["runs"]:
        rows = run["rows"]
        if not rows:
            lines.append(f"| {run['name']} | 0 | | | | {run['stopped']} | | | | |")
            continue
        lines.append(
            f"| {run['name']} | {len(rows)} | {run['prompt_tokens']:,} | "
            f"{run['prompt_tokens_per_s']:,.0f} | {rows[-1]['context_end']:,} | "
            f"{run['stopped'] or 'no'} | **{run['device_allocs']}** | "
            f"{run['min_peak_over_plan']:.3f}-{run['max_peak_over_plan']:.3f} | "
            f"{run['max_transient_over_activations']:.3f} | "
            f"{run['transient_over_formula_here'][0]:.3f}-{run['transient_over_formula_here'][1]:.3f} |")
    ratio = ratio_at_same_contexts(res)
    what = {"gemm": "weight-only GEMMs at every size", "mhc": "mHC in PyTorch"}
    if ratio is not None:
        lines += ["", f"Previous path ({what[res.get('previous_kind', 'mhc')]}) over the new one "
                      f"at the same contexts: {ratio:.2f}x the time."]
    ratio = ratio_at_same_contexts(res, "prompt-previous-gemm", "prompt")
    if ratio is not None:
        lines += ["", f"Plain prompt, weight-only GEMMs over the FP8-activation ones at the same "
                      f"contexts: {ratio:.2f}x the time."]
    inc = _run(res, "incident")
    if inc and inc["rows"]:
        rows = inc["rows"]
        step = max(1, len(rows) // 16)
        lines += ["", "| context | ms | prompt tok/s | peak GiB | plan GiB | transient GiB | "
                      "activations GiB | allocs |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else []):
            lines.append(
                f"| {r['context_end']:,} | {r['seconds'] * 1e3:.0f} | "
                f"{r['tokens'] / r['seconds']:,.0f} | {r['peak_bytes'] / GiB:.2f} | "
                f"{res['plan_held_bytes'] / GiB:.2f} | {r['transient_bytes'] / GiB:.3f} | "
                f"{res['plan_activations_bytes'] / GiB:.3f} | {r['device_allocs']} |")
    return "\n".join(lines) + "\n"


def write_report(res: dict[str, Any], docs: Path) -> int:
    res = replan(res)
    plot(res, results_dir(docs) / PNG)
    write_marked_section(docs / "deepseek_v4.md", BEGIN, END, render(res), heading=HEADING)
    return 0
