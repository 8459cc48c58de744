"""lab.bench.deepseek_v4.hc_decode_warps on the CPU (interpreter, tiny shape): the default warps
first, every choice's outputs against it, and a bad choice refused with the field named."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.errors import KernelArgumentError
from kernels.hc_decode import hc_decode, hc_decode_partial_shape
from lab.bench.deepseek_v4 import hc_decode_warps


def test_hc_decode_warps_rows(interpret, tmp_path) -> None:
    from kernels._hc_decode_triton import hc_decode_warps as default

    out = tmp_path / "w.json"
    assert hc_decode_warps.main(["--warps", "4,4,2;4,1,2;1,1,1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert default(1) == (4, 1, 2) and default(8) == (2, 1, 1)
    assert [tuple(r["warps"]) for r in rows] == [(4, 1, 2), (4, 4, 2), (1, 1, 1)]
    assert all(r["batch"] == 1 and r["max_diff"] < 1e-6 for r in rows), rows


def test_hc_decode_rejects_bad_warps(interpret) -> None:
    n, m, d = 1, 4, 64
    f32 = dict(dtype=torch.float32)
    s = torch.randn(n, m, d)
    with pytest.raises(KernelArgumentError, match="warps"):
        hc_decode(s, torch.randn((2 + m) * m, m * d), torch.zeros((2 + m) * m), torch.ones(3),
                  torch.ones(d), 3, 1e-6, 1e-6,
                  partial=torch.empty(hc_decode_partial_shape(n, m, d), **f32),
                  x=torch.empty(n, d), post=torch.empty(n, m), comb=torch.empty(n, m, m),
                  warps=(4, 3, 2))
    with pytest.raises(SystemExit):
        hc_decode_warps.main(["--warps", "4,1"])
