"""Figures of the split benchmark from its stream records: inter-token latency (p50 / p99 / max,
overall, while a long prompt is being prefilled, and while one is in flight until its last
token), TTFT and completion time of the long prompts, throughput; and the PNG with ITL over time
(long prompts marked) and device memory over time, one column per arm.

In the split arm a long prompt's first token comes from the prefill worker, before the decode
worker has fetched its KV: the handoff shows in the time to its second token, so "in flight"
(arrival to last token) is the window that holds both prefill and handoff in either arm.

``python -m bench.split_report split.json`` recomputes the summaries and the PNG of a saved run.
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


def long_windows(records: list[StreamRecord], *, until_last: bool = False
                 ) -> list[tuple[float, float]]:
    """[arrival, first token] of every long prompt (its prefill), or [arrival, last token]
    (``until_last``: prefill, handoff and its few output tokens)."""
    return [(r.start_s, r.token_s[-1 if until_last else 0]) for r in records
            if r.kind == "long" and r.token_s]


def _itl(values: list[float]) -> dict[str, Any]:
    return {"p50": _ms(_pct(values, 0.5)), "p99": _ms(_pct(values, 0.99)),
            "max": _ms(max(values) if values else None), "count": len(values)}


def summarize(records: list[StreamRecord], duration_s: float) -> dict[str, Any]:
    gaps = chat_gaps(records)

    def within(windows: list[tuple[float, float]]) -> list[float]:
        return [g for t, g in gaps if any(a <= t <= b for a, b in windows)]

    chat_tokens = sum(1 for r in records if r.kind == "chat" for t in r.token_s if t <= duration_s)
    chats = [r for r in records if r.kind == "chat" and r.ttft_s is not None]
    longs = [r for r in records if r.kind == "long"]
    return {
        "itl_ms": _itl([g for _, g in gaps]),
        "itl_ms_while_long_prefill": _itl(within(long_windows(records))),
        "itl_ms_while_long_in_flight": _itl(within(long_windows(records, until_last=True))),
        "long_ttft_s": [{"prompt_tokens": r.prompt_tokens or r.prompt_chars,
                         "arrived_s": round(r.start_s, 2),
                         "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3),
                         "second_token_s": (round(r.token_s[1] - r.start_s, 3)
                                            if len(r.token_s) > 1 else None),
                         "last_token_s": (round(r.token_s[-1] - r.start_s, 3)
                                          if r.token_s else None),
                         "error": r.error} for r in longs],
        "chat_ttft_s": {k: None if v is None else round(v, 3) for k, v in (
            ("p50", _pct([r.ttft_s for r in chats], 0.5)),
            ("p99", _pct([r.ttft_s for r in chats], 0.99)),
            ("max", max((r.ttft_s for r in chats), default=None)))},
        "chat_output_tokens_per_s": round(chat_tokens / duration_s, 1),
        "chats_finished": sum(1 for r in records if r.kind == "chat" and not r.error
                              and r.token_s and r.token_s[-1] <= duration_s),
        "errors": [r.error for r in records if r.error][:10],
        "num_errors": sum(1 for r in records if r.error),
    }


def resident_check(arm: dict[str, Any]) -> dict[str, Any]:
    """Arm split: device memory its processes use (nvidia-smi's total less processes of no role,
    such as the bench's own CUDA context) against both plans, taken before any request. The
    prefill plan counts the weights it owns, the decode plan only what it owns: their sum is
    "weights once + both plans"; a second copy of the weights would add the arena again."""
    plans = [w["plan_mib"] for w in arm["workers"].values()]
    idle = arm["idle_device_mib"]
    used = idle.get("total")
    if used is None or None in plans:
        return {"ok": None, "why": "nvidia-smi total or a plan line missing"}
    others = sum(v for k, v in idle.items() if k.startswith("pid "))
    arena = max((w["weights"]["mib"] for w in arm["workers"].values() if w.get("weights")),
                default=0.0)
    expected = sum(plans)
    own = used - others
    return {"device_used_mib": used, "other_processes_mib": others, "arm_used_mib": own,
            "plans_mib": plans, "expected_mib": expected, "weights_mib": arena,
            "with_two_copies_mib": expected + arena, "ratio": round(own / expected, 4),
            "within_5pct": abs(own / expected - 1) <= 0.05}


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
            if r.token_s:  # darker: until its first token; lighter: until its last
                ax.axvspan(r.start_s, r.token_s[0], color=c, alpha=0.18)
                ax.axvspan(r.token_s[0], r.token_s[-1], color=c, alpha=0.07)
        ax.set_yscale("log")
        ax.set_ylabel("inter-token latency of the chats (ms)")
        ax.set_title(f"{name}: chat ITL; dashed: a long prompt arrives, shaded: until its 1st"
                     " / last token", fontsize=9)
        handles = [plt.Line2D([], [], color=c, ls="--", label=f"{n:,}-token prompt")
                   for n, c in colors.items()]
        if handles:
            ax.legend(handles=handles, loc="upper right", fontsize=8)
        mx = axes[1][col]
        samples = arm.get("memory") or []
        labels = sorted({k for _, m in samples for k in m})
        for label in labels:
            pts = [(t, m[label]) for t, m in samples if label in m]
            mx.plot([t for t, _ in pts], [v / 1024 for _, v in pts],
                    label=f"{label} (not the arm's)" if label.startswith("pid ") else label)
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


def main(argv: list[str] | None = None) -> int:
    """Recompute the summaries (and the PNG beside it) of a saved ``split.json`` in place."""
    import json
    import sys

    path = Path((argv if argv is not None else sys.argv[1:])[0])
    body = json.loads(path.read_text())
    arms = {}
    for name, arm in body["arms"].items():
        if "records" not in arm:
            continue
        records = [StreamRecord(r["kind"], r["prompt_chars"], r["start_s"], r["token_s"],
                                r["output_tokens"], r["prompt_tokens"], r["error"])
                   for r in arm["records"]]
        arm["summary"] = summarize(records, float(body["args"]["duration_s"]))
        if name == "split" and arm.get("workers"):
            arm["resident_check"] = resident_check(arm)
        arms[name] = {**arm, "records": records}
    path.write_text(json.dumps(body, default=str))
    plot(path.with_suffix(".png"), arms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
