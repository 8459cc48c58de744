"""The router's metrics once more under vLLM's names, so dashboards and alerts written for vLLM
(``vllm:time_to_first_token_seconds``, ``vllm:num_requests_running``, ...) work unchanged.

Built at scrape time from the ``bulkhead_*`` series and the workers' last GetInfo: one source
of truth, nothing counted twice on the request path. Every series carries ``model_name`` (the
served model id, as vLLM labels it); per-worker gauges also carry ``engine`` (the worker's
address; vLLM puts an engine index there) and ``role``. Only series with a real counterpart are
exported; docs/metrics.md lists each with its source. This module must never block: it reads
in-memory values only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from router.policy import WorkerLoad

if TYPE_CHECKING:
    from router.metrics import RouterMetrics

# vLLM name -> (bulkhead histogram attribute of RouterMetrics, labels it must match, help)
HISTOGRAMS: dict[str, tuple[str, dict[str, str], str]] = {
    "vllm:time_to_first_token_seconds": (
        "ttft", {}, "Time to first token: request arrival at the router to the first token sent."),
    "vllm:inter_token_latency_seconds": (
        "itl", {}, "Time between two consecutive tokens of one choice."),
    "vllm:time_per_output_token_seconds": (
        "itl", {}, "Deprecated vLLM name of vllm:inter_token_latency_seconds (same data)."),
    "vllm:e2e_request_latency_seconds": (
        "e2e", {"outcome": "ok"}, "End-to-end latency of successful requests: arrival to the "
        "last byte of the answer."),
}


def _samples(metric: MetricWrapperBase) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in metric.collect():
        for s in family.samples:
            yield s.name, s.labels, s.value


def _merged_histogram(metric: MetricWrapperBase, match: dict[str, str]
                      ) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets and sum of a labelled histogram, summed over the label values that
    agree with ``match`` (the routes of TTFT, for instance)."""
    buckets: dict[str, float] = {}
    total = 0.0
    for name, labels, value in _samples(metric):
        if any(labels.get(k) != v for k, v in match.items()):
            continue
        if name.endswith("_bucket"):
            buckets[labels["le"]] = buckets.get(labels["le"], 0.0) + value
        elif name.endswith("_sum"):
            total += value
    ordered = sorted(buckets.items(), key=lambda kv: float(kv[0]))
    return ordered, total


def _counter_total(metric: MetricWrapperBase, **match: str) -> float:
    return sum(v for name, labels, v in _samples(metric) if name.endswith("_total")
               and all(labels.get(k) == want for k, want in match.items()))


def _counter_by(metric: MetricWrapperBase, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in _samples(metric):
        if name.endswith("_total"):
            out[labels[label]] = out.get(labels[label], 0.0) + value
    return out


class VllmNamesCollector(Collector):
    """Yields the ``vllm:`` families from a RouterMetrics (``source``) and the worker loads."""

    def __init__(self, source: RouterMetrics, model_name: str,
                 loads: Callable[[], list[WorkerLoad]]) -> None:
        self._src = source
        self._model = model_name
        self._loads = loads

    def collect(self) -> Iterable[Metric]:
        m = [self._model]
        for vllm_name, (attr, match, doc) in HISTOGRAMS.items():
            fam = HistogramMetricFamily(vllm_name, doc, labels=["model_name"])
            buckets, total = _merged_histogram(getattr(self._src, attr), match)
            if buckets:
                fam.add_metric(m, buckets, total)
            yield fam
        src = self._src
        counters = (
            ("vllm:prompt_tokens", "Prompt tokens of the requests served.",
             _counter_total(src.prompt_tokens_seen)),
            ("vllm:generation_tokens", "Tokens generated.",
             _counter_total(src.generated_tokens)),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up for reuse (every prompt "
             "token is).", _counter_total(src.prompt_tokens_seen)),
            ("vllm:prefix_cache_hits", "Prompt tokens whose KV was reused (a worker's prefix "
             "cache or the external store) instead of computed.",
             _counter_total(src.kv_tokens, source="cached")),
        )
        for name, doc, value in counters:
            fam_c = CounterMetricFamily(name, doc, labels=["model_name"])
            fam_c.add_metric(m, value)
            yield fam_c
        success = CounterMetricFamily(
            "vllm:request_success_total", "Choices that finished, by finish reason (stop, "
            "length).", labels=["model_name", "finished_reason"])
        for reason, value in sorted(_counter_by(src.finished, "finish_reason").items()):
            success.add_metric([*m, reason], value)
        yield success
        yield from self._gauges()

    def _gauges(self) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "engine", "role"]
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Sequences running on a worker (its last GetInfo).",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Sequences queued on a worker (its last GetInfo).",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of a worker's KV extent "
                                  "in use, 0 to 1 (1 = full).", labels=labels)
        for w in self._loads():
            values = [self._model, w.address, w.role]
            running.add_metric(values, w.num_running)
            waiting.add_metric(values, w.num_waiting)
            if w.total_kv_tokens > 0:
                free = min(w.free_kv_tokens, w.total_kv_tokens)
                usage.add_metric(values, 1.0 - free / w.total_kv_tokens)
        yield from (running, waiting, usage)

    def describe(self) -> list[Metric]:
        return []
