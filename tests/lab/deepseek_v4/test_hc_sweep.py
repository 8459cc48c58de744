"""lab.bench.deepseek_v4.hc_sweep on the CPU (interpreter, tiny widths): every tile choice of the mHC
stream kernels and of the FP8 activation quantizer gives the default tiles' answer (the sums
regroup, the values do not change)."""

from __future__ import annotations

import json

from lab.bench.deepseek_v4 import hc_sweep


def test_hc_sweep_tiles_agree(interpret, tmp_path) -> None:
    out = tmp_path / "hc.json"
    assert hc_sweep.main(["--tokens", "19", "--mixes", "default;32,32,4,1;16,128,8,2;64,64,4,3",
                          "--collapse", "default;32,4;1024,4", "--merge", "default;16,2;1024,4",
                          "--act-quant", "default;64,4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["tiles"]) for r in rows] == [
        ("mixes", "default"), ("mixes", "32,32,4,1"), ("mixes", "16,128,8,2"), ("mixes", "64,64,4,3"),
        ("collapse", "default"), ("collapse", "32,4"), ("collapse", "1024,4"),
        ("merge", "default"), ("merge", "16,2"), ("merge", "1024,4"),
        ("act_quant 256", "default"), ("act_quant 256", "64,4"),
        ("act_quant 384", "default"), ("act_quant 384", "64,4")]
    for r in rows:
        assert r["max_diff_vs_first"] < 1e-5, r
