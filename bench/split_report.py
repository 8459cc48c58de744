"""Figures of the split benchmark from its stream records: inter-token latency (p50 / p99 / max,
overall and while a long prompt is being prefilled), TTFT of the long prompts, throughput; and
the PNG with ITL over time (long prompts marked) and device memory over time, one column per arm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.split_load import StreamRecord


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def chat_gaps(records: list[StreamRecord]) -> list[tuple[float, float]]:
    """(time the token arrived, gap since the previous token of its stream) for every chat."""
    out = []
    for r in records:
        if r.kind == "chat":
            out += [(b, b - a) for a, b in zip(r.token_s, r.token_s[1:], strict=False)]
    return sorted(out)


def long_windows(records: list[StreamRecord]) -> list[tuple[float, float]]:
    """[arrival, first token] of every long prompt (its prefill and handoff)."""
    return [(r.start_s, r.token_s[0]) for r in records if r.kind == "long" and r.token_s]


def summarize(records: list[StreamRecord], duration_s: float) -> dict[str, Any]:
    gaps = chat_gaps(records)
    values = [g for _, g in gaps]
    windows = long_windows(records)
    during = [g for t, g in gaps if any(a <= t <= b for a, b in windows)]
    chat_tokens = sum(1 for r in records if r.kind == "chat" for t in r.token_s if t <= duration_s)
    longs = [r for r in records if r.kind == "long"]
    return {
        "itl_ms": {"p50": _ms(_pct(values, 0.5)), "p99": _ms(_pct(values, 0.99)),
                   "max": _ms(max(values) if values else None), "count": len(values)},
        "itl_ms_while_long_prefill": {"p50": _ms(_pct(during, 0.5)),
                                      "p99": _ms(_pct(during, 0.99)),
                                      "max": _ms(max(during) if during else None),
                                      "count": len(during)},
        "long_ttft_s": [{"prompt_tokens": r.prompt_tokens or r.prompt_chars,
                         "arrived_s": round(r.start_s, 2),
                         "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3),
                         "error": r.error} for r in longs],
        "chat_output_tokens_per_s": round(chat_tokens / duration_s, 1),
        "chats_finished": sum(1 for r in records if r.kind == "chat" and not r.error
                              and r.token_s and r.token_s[-1] <= duration_s),
        "errors": [r.error for r in records if r.error][:10],
        "num_errors": sum(1 for r in records if r.error),
    }


def plot(path: Path, arms: dict[str, dict[str, Any]]) -> None:
    """``arms``: name -> {"records": [StreamRecord], "memory": [(t, {label: MiB})], "workers":
    {role: worker_log_figures}} (each worker's plan is drawn as a dotted line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(arms), figsize=(7 * len(arms), 8), squeeze=False,
                             sharex="col")
    colors = {}
    for col, (name, arm) in enumerate(arms.items()):
        ax = axes[0][col]
        gaps = chat_gaps(arm["records"])
        ax.scatter([t for t, _ in gaps], [1000 * g for _, g in gaps], s=2, alpha=0.5)
        for r in arm["records"]:
            if r.kind != "long":
                continue
            c = colors.setdefault(r.prompt_chars, f"C{len(colors) + 1}")
            ax.axvline(r.start_s, color=c, lw=1, ls="--")
            if r.token_s:
                ax.axvspan(r.start_s, r.token_s[0], color=c, alpha=0.12)
        ax.set_yscale("log")
        ax.set_ylabel("inter-token latency of the chats (ms)")
        ax.set_title(f"{name}: ITL (dashed: long prompt arrives; shaded: until its 1st token)")
        handles = [plt.Line2D([], [], color=c, ls="--", label=f"{n:,}-token prompt")
                   for n, c in colors.items()]
        if handles:
            ax.legend(handles=handles, loc="upper right", fontsize=8)
        mx = axes[1][col]
        samples = arm.get("memory") or []
        labels = sorted({k for _, m in samples for k in m})
        for label in labels:
            pts = [(t, m[label]) for t, m in samples if label in m]
            mx.plot([t for t, _ in pts], [v / 1024 for _, v in pts], label=label)
        plans = {role: w["plan_mib"] for role, w in (arm.get("workers") or {}).items()
                 if w.get("plan_mib")}
        for i, (role, mib) in enumerate(sorted(plans.items())):
            mx.axhline(mib / 1024, color=f"C{i + 3}", ls=":", lw=1, label=f"plan of {role}")
        if len(plans) > 1:
            mx.axhline(sum(plans.values()) / 1024, color="k", ls=":", lw=1, label="sum of plans")
        mx.set_xlabel("seconds since the workload started")
        mx.set_ylabel("device memory (GiB)")
        mx.set_title(f"{name}: device memory (nvidia-smi)")
        if labels or plans:
            mx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
