"""lab.bench.deepseek_v4.prefill_gemms --smoke: every V4 projection shape (widths / 32) through the
weight-only and w8a8 kernels and the experts through both forms, under the interpreter, each
close to its specification (what the GPU run of the same bench reports as errors)."""

from __future__ import annotations

import json

from lab.bench.deepseek_v4 import prefill_gemms


def test_prefill_gemms_smoke(interpret, tmp_path) -> None:
    out = tmp_path / "g.json"
    assert prefill_gemms.main(["--smoke", "--out", str(out), "--w8a8-tiles", "16,32,2,4,1"]) == 0
    res = json.loads(out.read_text())
    assert [r["case"] for r in res["fp8"]] == [p[0] for p in prefill_gemms.V4_PROJECTIONS]
    for r in res["fp8"]:
        assert r["w8a8"]["rel_err_vs_w8a8_ref"] < 1e-2, r  # bf16 output rounding only
        assert r["previous"]["rel_err_vs_w8a8_ref"] < 0.1, r  # the activations' rounding
        assert r["w8a8:16,32,2,4,1"]["rel_err_vs_w8a8_ref"] < 1e-2, r
    forms = {r["tiles"]: r for r in res["moe"]}
    assert "ms" in forms.pop("sort:all-pairs")  # the smoke's 260 pairs: no tiled sort
    assert set(forms) == {"fp8", "default"} and all("ms" in r for r in forms.values())
    assert forms["default"]["rel_err"] < 1e-2 and forms["fp8"]["rel_err"] < 0.1
