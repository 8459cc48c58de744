"""A dashboard written for vLLM works on Bulkhead: after real traffic through router + prefill +
decode processes, the router's /metrics (parsed with prometheus_client's own text parser) has
the `vllm:` series with `model_name`, and the queries a Grafana panel runs over two scrapes
(histogram_quantile over rate of buckets, rate of token counters) return values that agree with
what the client saw."""

from __future__ import annotations

import math
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import E2E

Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(e2e: E2E) -> dict[Sample, float]:
    with urllib.request.urlopen(e2e.deployment.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def increase(before: dict[Sample, float], after: dict[Sample, float], name: str,
             by: str | None = None, **match: str) -> dict[str, float]:
    """PromQL `sum by (by) (increase(name{match}[window]))` between two scrapes."""
    out: dict[str, float] = defaultdict(float)
    for (n, labels), value in after.items():
        lab = dict(labels)
        if n != name or any(lab.get(k) != v for k, v in match.items()):
            continue
        out[lab.get(by, "") if by else ""] += value - before.get((n, labels), 0.0)
    return dict(out)


def histogram_quantile(q: float, buckets: dict[str, float]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q."""
    edges = sorted((float(le), count) for le, count in buckets.items())
    total = edges[-1][1]
    if total <= 0:
        return math.nan
    rank = q * total
    lower_edge, lower_count = 0.0, 0.0
    for upper_edge, count in edges:
        if count >= rank:
            if math.isinf(upper_edge):
                return lower_edge  # Prometheus answers the highest finite bound
            width = count - lower_count
            frac = (rank - lower_count) / width if width > 0 else 1.0
            return lower_edge + (upper_edge - lower_edge) * frac
        lower_edge, lower_count = upper_edge, count
    return math.nan


def test_vllm_named_series_answer_grafana_queries_after_traffic(e2e: E2E) -> None:
    client = e2e.client()
    before = scrape(e2e)
    t0 = time.monotonic()

    def one(i: int) -> tuple[float, int, int, str | None]:
        started = time.monotonic()
        resp = client.completions.create(model=e2e.model, prompt=f"request {i}: the capital of",
                                         max_tokens=6 + i % 3, temperature=0)
        return (time.monotonic() - started, resp.usage.prompt_tokens,
                resp.usage.completion_tokens, resp.choices[0].finish_reason)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(8)))
    window_s = time.monotonic() - t0
    after = scrape(e2e)

    vllm_samples = [(n, dict(lab)) for n, lab in after if n.startswith("vllm:")]
    assert vllm_samples
    assert all(lab.get("model_name") == e2e.model for _, lab in vllm_samples), vllm_samples[:3]

    # histogram_quantile(0.5 | 0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[w])))
    ttft_buckets = increase(before, after, "vllm:time_to_first_token_seconds_bucket", by="le")
    assert ttft_buckets["+Inf"] == len(results)
    p50, p99 = (histogram_quantile(q, ttft_buckets) for q in (0.5, 0.99))
    slowest = max(r[0] for r in results)
    assert 0 < p50 <= p99, (p50, p99)
    # TTFT of a request is at most its whole latency, and bucket interpolation at most
    # rounds up to the bucket's upper edge.
    upper = min(float(le) for le, c in ttft_buckets.items() if c == len(results))
    assert p99 <= max(slowest, upper)

    e2e_buckets = increase(before, after, "vllm:e2e_request_latency_seconds_bucket", by="le")
    assert e2e_buckets["+Inf"] == len(results)
    assert histogram_quantile(0.5, e2e_buckets) > 0

    # rate(vllm:generation_tokens_total[w]) and rate(vllm:prompt_tokens_total[w])
    generated = increase(before, after, "vllm:generation_tokens_total")[""]
    prompt = increase(before, after, "vllm:prompt_tokens_total")[""]
    assert generated == sum(r[2] for r in results)
    assert prompt == sum(r[1] for r in results)
    assert generated / window_s > 0

    # sum by (finished_reason) (increase(vllm:request_success_total[w]))
    reasons = increase(before, after, "vllm:request_success_total", by="finished_reason")
    assert sum(reasons.values()) == len(results)
    for reason in {r[3] for r in results}:
        assert reasons[reason] == sum(1 for r in results if r[3] == reason)

    itl = increase(before, after, "vllm:inter_token_latency_seconds_count")[""]
    assert 0 < itl <= sum(r[2] - 1 for r in results)  # a delta may carry several tokens

    # Per-worker gauges: both workers, idle again, KV usage a fraction.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        series = {dict(lab)["role"]: v for (n, lab), v in after.items() if n == name}
        assert set(series) == {"prefill", "decode"}, (name, series)
        assert all(0.0 <= v <= (1.0 if name.endswith("perc") else 8) for v in series.values())

    # the per-request series (one observation per choice) and the engine's
    prompt_hist = increase(before, after, "vllm:request_prompt_tokens_sum")[""]
    assert prompt_hist == sum(r[1] for r in results)
    assert increase(before, after, "vllm:request_generation_tokens_sum")[""] == generated
    for stage in ("queue", "prefill", "decode"):
        count = increase(before, after, f"vllm:request_{stage}_time_seconds_count")[""]
        total = increase(before, after, f"vllm:request_{stage}_time_seconds_sum")[""]
        assert count == len(results) and 0 <= total <= sum(r[0] for r in results), stage
    assert increase(before, after, "vllm:request_prefill_time_seconds_sum")[""] > 0
    preempted = {dict(lab)["role"] for (n, lab) in after if n == "vllm:num_preemptions_total"}
    assert preempted == {"prefill", "decode"}
    config = [dict(lab) for (n, lab), v in after.items() if n == "vllm:cache_config_info"]
    assert {c["role"] for c in config} == {"prefill", "decode"}
    assert all(int(c["block_size"]) > 0 and int(c["num_gpu_blocks"]) > 0 for c in config)
