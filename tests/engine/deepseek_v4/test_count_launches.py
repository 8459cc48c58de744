"""bench.deepseek_v4.count_launches on a toy V4 under the Triton interpreter (its own process:
TRITON_INTERPRET must be set before triton is imported): the fused decode loop launches well
under half the unfused loop's kernels, and no mHC or RoPE PyTorch ops are left in it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_fused_decode_launches_a_third_of_the_kernels() -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "bench.deepseek_v4.count_launches", "--layers", "SCH"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_layer = dict(re.findall(r"\[launches\] (\w+): \d+ a step, ([\d.]+) a layer", proc.stdout))
    assert set(per_layer) == {"unfused", "fused"}, proc.stdout
    # a third until the unfused loop took the prefill path's norm + rope kernels (0d59cc2):
    # 235 -> 180 a layer there, the fused loop 65 a layer
    assert float(per_layer["fused"]) * 2.5 <= float(per_layer["unfused"]), proc.stdout
    fused = proc.stdout.split("[launches] fused")[1]
    assert "mhc.py" not in fused and "rope.py:apply_rope" not in fused and "_sinkhorn" not in fused
