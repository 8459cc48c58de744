"""The incident bench's plan search and its report (the run itself needs CUDA: the GPU tier).
The context is the largest the engine's plan fits, and the report renders runs and the ratio."""

from __future__ import annotations

import argparse
from pathlib import Path

from lab.bench.deepseek_v4.context import flash_config
from lab.bench.deepseek_v4.incident import FLASH_43
from lab.bench.deepseek_v4.incident_plan import largest_context, plan_for
from lab.bench.deepseek_v4.incident_report import (
    ratio_at_same_contexts,
    render,
    replan,
    write_report,
)

GiB = 2**30


def _args(**kw: object) -> argparse.Namespace:
    base = dict(decode_context=4096, chunk=4096, decodes=4, block_size=256, device="cuda",
                kv_dtype="auto", memory_utilization=0.92, target=1 << 20)
    return argparse.Namespace(**{**base, **kw})


def test_largest_context_is_the_last_that_fits() -> None:
    cfg = flash_config(FLASH_43, 128, 1 << 20)
    weights = 86_109_162_764  # the full-depth model measured on the H200
    h200 = int(139.8 * GiB)
    assert largest_context(cfg, _args(), weights, h200) == 1 << 20  # bf16 blocks of 256 fit 1M
    # 1M takes ~90 GiB of plan since the window rows left the blocks: 95 GiB cuts it short
    small = int(95 * GiB)
    ctx = largest_context(cfg, _args(), weights, small)
    assert 0 < ctx < 1 << 20 and ctx % 256 == 0
    assert plan_for(cfg, ctx, _args(), weights, small)[0].fits
    assert not plan_for(cfg, ctx + 256, _args(), weights, small)[0].fits
    plan, _, per_slot = plan_for(cfg, ctx, _args(), weights, small)
    assert plan.num_blocks == 1 + sum(per_slot) and per_slot[0] == ctx // 256


def _rows(times: list[float], tokens: int = 4092) -> list[dict[str, float]]:
    return [{"context_end": tokens * (i + 1), "tokens": tokens, "seconds": t, "decodes": 4,
             "peak_bytes": 100 * GiB, "transient_bytes": GiB, "resident_bytes": 99 * GiB,
             "device_allocs": 0} for i, t in enumerate(times)]


def _run(name: str, times: list[float], stopped: str | None = None) -> dict[str, object]:
    rows = _rows(times)
    return {"name": name, "rows": rows, "stopped": stopped, "device_allocs": 0,
            "prompt_tokens": sum(r["tokens"] for r in rows), "seconds": sum(times),
            "prompt_tokens_per_s": sum(r["tokens"] for r in rows) / sum(times),
            "min_peak_over_plan": 0.95, "max_peak_over_plan": 0.97,
            "max_transient_over_activations": 0.93}


def test_report_renders_runs_ratio_and_plot(tmp_path: Path) -> None:
    res = {"device": "H200", "torch": "x", "layers": FLASH_43, "experts": 128, "chunk": 4096,
           "decodes": 4, "decode_context": 4096, "block_size": 256, "kv_dtype": "auto",
           "target": 1 << 20, "context": 1 << 20, "weights_bytes": 82_375_274_332,
           "plan": {"total_bytes": 110 * GiB, "budget_bytes": 128 * GiB,
                    "memory_utilization": 0.92, "device_memory_bytes": int(139.8 * GiB)},
           "plan_activations_bytes": GiB, "plan_held_bytes": 103 * GiB,
           "runs": [_run("previous-path", [2.0, 2.0]), _run("incident", [1.0, 1.0, 1.0], "deadline")]}
    assert ratio_at_same_contexts(res) == 2.0
    again = replan(res)
    assert again["plan_held_bytes"] != res["plan_held_bytes"]  # today's plan, same measurements
    assert [r["peak_bytes"] for r in again["runs"][1]["rows"]] == [100 * GiB] * 3
    text = render(again)
    assert "| incident | 3 | 12,276 |" in text and "2.00x the time" in text
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "deepseek_v4.md").write_text("# t\n")
    assert write_report(res, docs) == 0
    # the plot goes to the lab's results beside docs/, and the page links it there
    assert (tmp_path / "lab" / "results" / "deepseek_v4_incident.png").stat().st_size > 0
    text = (docs / "deepseek_v4.md").read_text()
    assert "bench_incident:begin" in text and "today's formulas" in text  # re-planned
    assert "](../lab/results/deepseek_v4_incident.png)" in text


def test_tile_flags_name_themselves_on_bad_input() -> None:
    """--moe-tiles / --moe-fp8-tiles: five positive integers at least, or an exit naming the flag."""
    import pytest

    from lab.bench.deepseek_v4.incident import _tiles_arg

    assert _tiles_arg("moe_tiles", "256,64,128,8,3,1,0,1,1") == (256, 64, 128, 8, 3, 1, 0, 1, 1)
    for bad in ("1,2,3", "a,b,c,d,e", "128,0,128,8,3"):
        with pytest.raises(SystemExit, match="--moe-fp8-tiles"):
            _tiles_arg("moe_fp8_tiles", bad)
