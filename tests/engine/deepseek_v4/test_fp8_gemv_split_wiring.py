"""The FP8 linears' decode split-K variant through the engine: when the default decode variant
splits K, ``Fp8Linear`` takes its fp32 partials from the bound Workspace (no allocation behind
its back), the result matches the reference, and the planner's term covers what was taken.
CPU tier through the Triton interpreter; the split default is patched (it is off until the
lead measures it)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear
from engine.workspace import Workspace
from kernels.fp8_linear_ref import fp8_grouped_linear_ref, fp8_linear_ref

# the module, not the function ``kernels`` re-exports under the same name
fp8_linear_mod = importlib.import_module("kernels.fp8_linear")


def _split_default(monkeypatch: pytest.MonkeyPatch, split: int) -> None:
    plain = fp8_linear_mod.fp8_gemv_variant

    def variant(m: int, n: int, k: int, block_k: int):
        v = plain(m, n, k, block_k)
        return None if v is None else fp8_linear_mod.Fp8GemvVariant(v.tiles, split)

    monkeypatch.setattr(fp8_linear_mod, "fp8_gemv_variant", variant)


@pytest.mark.parametrize(("groups", "rows", "n", "k"), [(1, 3, 200, 300), (2, 1, 144, 260)])
def test_fp8_linear_split_k_takes_workspace(monkeypatch, groups, rows, n, k) -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tier needs TRITON_INTERPRET=1")
    _split_default(monkeypatch, 2)
    g = torch.Generator().manual_seed(n)
    lin = Fp8Linear((groups * n, k), groups=groups)
    lin.weight = (torch.randn(groups * n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    lin.scale = torch.rand(-(-groups * n // 128), -(-k // 128), generator=g) * 1e-2
    lin.use_kernels = True
    need = fp8_linear_mod.fp8_linear_scratch_bytes(rows, groups * n, k)
    assert need == 2 * rows * groups * n * 4
    ws = Workspace(need, "cpu")
    lin.workspace = ws
    if groups > 1:
        x = torch.randn(rows, groups, k, generator=g)
        ref = fp8_grouped_linear_ref(x, lin.weight, lin.scale)
    else:
        x = torch.randn(rows, k, generator=g)
        ref = fp8_linear_ref(x, lin.weight, lin.scale)
    torch.testing.assert_close(lin(x), ref, rtol=1e-4, atol=1e-4)
    assert ws.peak_bytes >= need  # the partials came from the arena


def test_planner_counts_the_split_partials(monkeypatch) -> None:
    from engine.models.deepseek_v4.memory.sizing import (
        deepseek_v4_workspace_bytes,
        fp8_gemv_split_bytes,
    )
    from tests.engine.deepseek_v4.test_deepseek_v4_quantized import RAW

    assert fp8_gemv_split_bytes(RAW, 16) == 0  # the default does not split
    base = deepseek_v4_workspace_bytes(RAW, 16, 64, fp8_linears=True)
    _split_default(monkeypatch, 4)
    # o_b (hidden 160 outputs over 2 x 72 = 144 inputs: two 128-wide K-tiles, two slices) is
    # one of the projections the planner takes the largest of
    split = fp8_gemv_split_bytes(RAW, 16)
    assert split >= fp8_linear_mod.fp8_linear_scratch_bytes(16, 160, 144) == 2 * 16 * 160 * 4
    assert deepseek_v4_workspace_bytes(RAW, 16, 64, fp8_linears=True) >= max(base, split + 256)
