"""What `bulkhead bench` makes of its measurements: per-request records, nearest-rank
percentiles, the summary dict written as JSON and the printed table (the PNG is
bench/load_plot.py).

Pure functions of the records, so they are tested without a server. Must never import torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int
    prompt_words: int
    start_s: float = 0.0  # since the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    error: str | None = None


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99/max/mean by the nearest-rank method; None when there is no value."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    s = sorted(values)

    def rank(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]

    return {
        "p50": rank(50),
        "p90": rank(90),
        "p99": rank(99),
        "max": s[-1],
        "mean": sum(s) / len(s),
    }


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_token_throughput": out_tokens / wall_s if wall_s > 0 else 0.0,
        "total_token_throughput": (out_tokens + in_tokens) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def format_table(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    lines = [
        f"requests {summary['completed']}/{summary['requests']} ok, {summary['failed']} failed, "
        f"{summary['duration_s']:.2f} s",
        f"throughput: {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_token_throughput']:.1f} output tok/s, "
        f"{summary['total_token_throughput']:.1f} total tok/s",
        f"{'metric (ms)':<14}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}{'mean':>10}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = summary[key]
        lines.append(
            f"{label:<14}"
            + "".join(f"{ms(p[k]):>10}" for k in ("p50", "p90", "p99", "max", "mean"))
        )
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)
