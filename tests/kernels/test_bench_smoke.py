"""`python -m bench.kernels --smoke` runs every benchmark path at toy sizes (CPU interpreter),
so the GPU run is not the first time the script executes."""

from __future__ import annotations

import json

import pytest

from bench import kernels as bench


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
