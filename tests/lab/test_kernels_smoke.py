"""`python -m lab.bench.kernels --smoke` runs every benchmark path at toy sizes (CPU interpreter),
so the GPU run is not the first time the script executes."""

from __future__ import annotations

import json

import pytest

from lab.bench import kernels as bench


@pytest.mark.slow
def test_bench_smoke_runs_every_path(interpret, tmp_path) -> None:
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--only", "sweep", "--only", "indexer", "--only", "sparse", "--only",
                "paged", "--json", str(out)])
    report = json.loads(out.read_text())
    assert all("ms" in r for r in report["sweep"])
    for row in report["indexer"]:
        assert row["indices_identical"] and row["scores_identical"]
        assert row["fp8_indices_identical"]
    assert all(r["rel_err_vs_ref"] < 2e-2 for r in report["sparse"])
    assert all(r.get("rel_err_vs_ref", 0) < 2e-2 for r in report["paged"])


def test_bench_smoke_runs_the_quantized_cases(interpret, tmp_path) -> None:
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--only", "quant", "--json", str(out)])
    rows = json.loads(out.read_text())["quant"]
    assert {r["case"] for r in rows} == {"fp8_linear", "mxfp4_moe"}
    assert all(r["rel_err_vs_ref"] < 2e-2 for r in rows if "rel_err_vs_ref" in r)


def test_decode_variant_sweep_smoke(interpret, tmp_path) -> None:
    """`python -m lab.bench.quant_decode_sweep --smoke`: every kind of decode variant (split-K dot
    form, no-dot form, MoE splits, the experts' per-pair form) runs end to end on toy shapes and matches its reference."""
    from lab.bench.quant_decode_sweep import main

    out = tmp_path / "sweep.json"
    main(["--smoke", "--fp8-split", "1,3", "--fp8-sum-bn", "4", "--moe-split", "1x1,2x2",
          "--json", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["form"] for r in rows if r["case"] == "fp8_gemv"} == {"dot", "sum"}
    assert {r["slices"] for r in rows if r["case"] == "fp8_gemv"} == {1, 3}
    moe = [r for r in rows if r["case"] == "mxfp4_moe"]
    assert {r["variant"] for r in moe if r["splits"] is None} == {"default"}
    assert {tuple(r["splits"]) for r in moe if r["splits"]} == {(1, 1), (2, 2)}
    assert {r["tiles"][0] for r in moe if r["tiles"]} == {16, 1}  # the tiled and per-pair forms
    assert all(r["rel_err"] < 2e-2 for r in rows)
    assert len(report["best"]) == 8  # 2 fp8 shapes x 3 row counts + 2 token counts
