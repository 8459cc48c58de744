"""`bulkhead bench` against the real router with fake workers: bounded, measured, written out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.load import main
from bench.load_report import percentiles
from tests.router.conftest import Cluster

pytestmark = pytest.mark.timeout(120)   # a hang is a failure, never a stuck CI


def test_percentiles_nearest_rank() -> None:
    p = percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["max"], p["mean"]) == (50, 90, 99, 100, 50.5)
    assert percentiles([])["p50"] is None


def test_bench_concurrency_with_long_prompts(reset: Cluster, tmp_path: Path) -> None:
    reset.decode[0].token_delay_s = 0.005
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["--base-url", reset.base_url, "--num-requests", "12", "--concurrency", "4",
               "--prompt-tokens", "2", "--output-tokens", "6", "--long-prompt-tokens", "40",
               "--long-prompt-every", "4", "--endpoint", "completions", "--out-json", str(out_json),
               "--out-png", str(out_png)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    s = data["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (12, 12, 0)
    assert s["output_tokens"] == 12 * 6
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert s[key]["p50"] is not None and s[key]["p50"] <= s[key]["p99"] <= s[key]["max"]
    assert all(r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) >= 1 for r in data["requests"])
    assert [r["prompt_words"] for r in data["requests"]][3::4] == [40, 40, 40]
    # the long prompts took the split path, the short ones did not
    assert len(reset.prefill[0].prefills) == 3 and len(reset.decode[0].generates) == 12
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The picture says what was measured: model, concurrency, requests, throughput in the
    # title; p50/p99 marked on the latency panels; a requests-over-time panel.
    from bench.load_plot import build_figure
    from bench.load_report import RequestRecord

    records = [RequestRecord(**r) for r in data["requests"]]
    fig = build_figure(s, records)
    title = fig._suptitle.get_text()
    assert s["model"] and s["model"] in title
    assert "concurrency 4" in title and "12/12 requests" in title
    assert f"{s['output_token_throughput']:.1f} output tok/s" in title
    legends = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    for pct in ("p50", "p99"):
        assert sum(t.startswith(pct) for t in legends) == 3, legends
    assert any(ax.get_title() == "requests over time" for ax in fig.axes)


def test_bench_rate_and_duration_bound(reset: Cluster, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    rc = main(["--base-url", reset.base_url, "--num-requests", "1000", "--request-rate", "20",
               "--duration-s", "0.5", "--output-tokens", "2", "--prompt-tokens", "4",
               "--endpoint", "chat", "--out-json", str(out_json), "--out-png", ""])
    assert rc == 0
    s = json.loads(out_json.read_text())["summary"]
    assert 1 <= s["requests"] <= 40 and s["failed"] == 0


def test_bench_reports_failures_and_bad_options(reset: Cluster, tmp_path: Path,
                                               capsys: object) -> None:
    assert main(["--concurrency", "0"]) == 2
    out_json = tmp_path / "f.json"
    rc = main(["--base-url", reset.base_url, "--model", "nope", "--num-requests", "2",
               "--out-json", str(out_json), "--out-png", ""])
    assert rc == 1
    s = json.loads(out_json.read_text())["summary"]
    assert s["failed"] == 2 and "HTTP 404" in s["errors"][0]
