"""Prometheus metrics of one router app, in a registry owned by that app (no global registry).

Latencies (TTFT, inter-token, end-to-end, time per phase) are histograms; requests are counted by
outcome; KV tokens by how the prompt was served (loaded from the store vs recomputed); worker
queue depth and load are read from the worker registry at scrape time. The same values are
exported again under vLLM's names with a ``model_name`` label (router/vllm_metrics.py);
docs/metrics.md documents every series. This module must never block and never label by
request content.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.policy import WorkerLoad
from router.vllm_metrics import VllmNamesCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000, 200000, 500000, 1000000)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


# (name, help, value) of each per-worker gauge, read from the registry at scrape time
_WORKER_GAUGES: tuple[tuple[str, str, Callable[[WorkerLoad], float]], ...] = (
    ("bulkhead_worker_queue_depth", "Requests waiting in a worker's queue (last GetInfo).",
     lambda w: w.num_waiting),
    ("bulkhead_worker_running", "Requests running on a worker (last GetInfo).",
     lambda w: w.num_running),
    ("bulkhead_worker_healthy", "1 if the worker answers GetInfo.",
     lambda w: 1.0 if w.healthy else 0.0),
    ("bulkhead_worker_free_kv_tokens", "KV tokens not held by any sequence (last GetInfo).",
     lambda w: w.free_kv_tokens),
    ("bulkhead_worker_router_inflight",
     "Choices this router has sent to a worker and not seen end.", lambda w: w.num_inflight),
)


class _WorkerCollector(Collector):
    def __init__(self, loads: Callable[[], list[WorkerLoad]], model_name: str = "") -> None:
        self._loads = loads

    def collect(self) -> Iterator[GaugeMetricFamily]:
        loads = self._loads()
        for name, help_text, value in _WORKER_GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["worker", "role"])
            for w in loads:
                gauge.add_metric([w.address, w.role], value(w))
            yield gauge

    def describe(self) -> list[GaugeMetricFamily]:
        return []


class RouterMetrics:
    """The router's metrics; one instance per app."""

    def __init__(self, loads: Callable[[], list[WorkerLoad]], model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("bulkhead_time_to_first_token_seconds",
                              "Request arrival to first token sent.", ["route"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("bulkhead_inter_token_latency_seconds",
                             "Time between two consecutive tokens of one choice.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("bulkhead_e2e_request_latency_seconds",
                             "Request arrival to last byte of the answer.", ["outcome"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("bulkhead_phase_seconds",
                               "Time spent per phase: tokenize, lookup, prefill, first_token, "
                               "decode.", ["phase"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("bulkhead_requests", "Requests by outcome (ok or error code).",
                                ["outcome"], registry=r)
        self.routes = Counter("bulkhead_routes", "Choices by route: split or decode.", ["route"],
                              registry=r)
        self.prefill_retries = Counter("bulkhead_prefill_retries",
                                       "Prefills retried on another prefill worker after the "
                                       "first one failed.", registry=r)
        self.worker_crashes = Counter(
            "bulkhead_worker_crash_calls",
            "Calls cut by their worker's death, by verdict on their request: blamed "
            "(quarantined) or bystander (answered 503, not retried elsewhere).", ["verdict"],
            registry=r)
        self.kv_tokens = Counter("bulkhead_prompt_tokens",
                                 "Prompt tokens by how they were served: loaded (KV from the "
                                 "store), cached (any reuse, loaded included), recomputed.",
                                 ["source"], registry=r)
        self.generated_tokens = Counter("bulkhead_generation_tokens", "Tokens generated.",
                                        registry=r)
        self.prompt_tokens_seen = Counter("bulkhead_choice_prompt_tokens",
                                          "Prompt tokens of every choice that reached a worker.",
                                          registry=r)
        self.finished = Counter("bulkhead_finished_choices",
                                "Choices that finished, by finish reason (stop, length).",
                                ["finish_reason"], registry=r)
        self.request_prompt_tokens = Histogram(
            "bulkhead_request_prompt_tokens", "Prompt tokens of each finished choice.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "bulkhead_request_generation_tokens", "Tokens generated by each finished choice.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_time = Histogram(
            "bulkhead_request_time_seconds", "Each finished choice's time per stage: queue "
            "(arrival on the worker that computed the prompt to its engine's admission), "
            "prefill (admission to the first token), decode (first token to last, at the "
            "router).", ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("bulkhead_router_requests_in_flight",
                               "Requests the router is serving now.", registry=r)
        r.register(_WorkerCollector(loads))
        r.register(VllmNamesCollector(self, model_name, loads))

    def render(self) -> bytes:
        return generate_latest(self.registry)
