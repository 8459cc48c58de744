"""The PNG of a `bulkhead bench` run: one picture that says what was measured and how it went.

Title: model, endpoint, concurrency (and rate), request count, throughput. Panels: TTFT and
inter-token latency CDFs with p50/p99 marked, end-to-end latency of each request by its start
time with p50/p99 lines, and requests over time (in flight, finished). matplotlib is imported
only here, and only when a plot is asked for; this module never talks to a server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from bench.load_report import RequestRecord


def title(summary: dict[str, Any]) -> str:
    rate = summary.get("request_rate")
    load = f"concurrency {summary['concurrency']}"
    if rate is not None and math.isfinite(rate):
        load += f", {rate:g} req/s offered"
    return (f"bulkhead bench: {summary['model']} ({summary['endpoint']}), {load}, "
            f"{summary['completed']}/{summary['requests']} requests ok\n"
            f"{summary['request_throughput']:.2f} req/s, "
            f"{summary['output_token_throughput']:.1f} output tok/s in "
            f"{summary['duration_s']:.1f} s; prompt ~{summary['prompt_tokens_per_request']} "
            f"tokens, output {summary['output_tokens_per_request']} tokens")


def _mark(ax: Axes, p: dict[str, float | None], vertical: bool) -> None:
    for key, style in (("p50", "--"), ("p99", ":")):
        v = p.get(key)
        if v is None:
            continue
        ms = v * 1000
        line = ax.axvline if vertical else ax.axhline
        line(ms, color="tab:red", linestyle=style, label=f"{key} {ms:.1f} ms")


def _cdf(ax: Axes, values_ms: list[float], p: dict[str, float | None], name: str) -> None:
    s = sorted(values_ms)
    if s:
        ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], color="tab:blue")
    _mark(ax, p, vertical=True)
    ax.set_title(f"{name}, CDF ({len(s)} samples)")
    ax.set_xlabel("ms")
    ax.set_ylabel("share at or below")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")


def build_figure(summary: dict[str, Any], records: Sequence[RequestRecord]) -> Figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.error is None and r.e2e_s is not None]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    _cdf(axes[0][0], [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], summary["ttft_s"],
         "time to first token")
    _cdf(axes[0][1], [x * 1000 for r in ok for x in r.itl_s], summary["itl_s"],
         "inter-token latency")

    ax = axes[1][0]
    ax.scatter([r.start_s for r in ok], [(r.e2e_s or 0.0) * 1000 for r in ok], s=10)
    _mark(ax, summary["e2e_s"], vertical=False)
    ax.set_title("end-to-end latency by request start")
    ax.set_xlabel("request start (s since the run began)")
    ax.set_ylabel("ms")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")

    ax = axes[1][1]
    # Requests over time: how many were in flight and how many had finished at each moment.
    events = sorted([(r.start_s, 1) for r in ok] + [(r.start_s + (r.e2e_s or 0.0), -1)
                                                    for r in ok])
    times, in_flight, done = [0.0], [0], [0]
    for t, step in events:
        times.append(t)
        in_flight.append(in_flight[-1] + step)
        done.append(done[-1] + (step < 0))
    ax.step(times, in_flight, where="post", label="in flight")
    ax.axhline(summary["concurrency"], color="grey", linestyle="--",
               label=f"concurrency cap {summary['concurrency']}")
    ax.set_xlabel("s since the run began")
    ax.set_ylabel("requests in flight")
    ax2 = ax.twinx()
    ax2.plot(times, done, color="tab:green", label="finished (cumulative)")
    ax2.set_ylabel("requests finished")
    ax.set_title("requests over time")
    ax.grid(True, alpha=0.3)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left")

    fig.suptitle(title(summary), fontsize=11)
    fig.tight_layout()
    return fig


def plot(summary: dict[str, Any], records: Sequence[RequestRecord], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = build_figure(summary, records)
    fig.savefig(path, dpi=100)
    plt.close(fig)
