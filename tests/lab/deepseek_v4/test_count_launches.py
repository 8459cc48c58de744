"""lab.bench.deepseek_v4.count_launches on a toy V4 under the Triton interpreter (its own process:
TRITON_INTERPRET must be set before triton is imported): the fused decode loop launches well
under half the unfused loop's kernels, and no mHC or RoPE PyTorch ops are left in it. Every
distinct launch those steps made (argument types as the engine passed them) compiles for sm_90
and sm_120: the interpreter runs kernels the GPU backend may reject (an int64 index bitcast to
32 bits did, unseen until an H100 run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


ROOT = Path(__file__).resolve().parents[3]


def _launches_compile(records: Path) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    for arch in ("90", "120"):
        proc = subprocess.run([sys.executable, "-m", "kernels.compile_check", "--records",
                               str(records), "--arch", arch, "--failures-only"], env=env,
                              capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert re.search(rf"(\d+) of \1 compile for sm_{arch}", proc.stdout), proc.stdout[-500:]


@pytest.mark.slow
def test_fused_decode_launches_a_third_of_the_kernels(tmp_path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    rec = tmp_path / "launches.json"
    proc = subprocess.run([sys.executable, "-m", "lab.bench.deepseek_v4.count_launches", "--layers", "SCH",
                           "--record", str(rec)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_layer = dict(re.findall(r"\[launches\] (\w+): \d+ a step, ([\d.]+) a layer", proc.stdout))
    assert set(per_layer) == {"unfused", "fused"}, proc.stdout
    # a third until the unfused loop took the prefill path's norm + rope kernels (0d59cc2):
    # 235 -> 180 a layer there, the fused loop 65 a layer
    assert float(per_layer["fused"]) * 2.5 <= float(per_layer["unfused"]), proc.stdout
    fused = proc.stdout.split("[launches] fused")[1]
    assert "mhc.py" not in fused and "rope.py:apply_rope" not in fused and "_sinkhorn" not in fused
    _launches_compile(rec)


@pytest.mark.slow
def test_mixed_step_launches_compile_for_both_gpus(tmp_path) -> None:
    """The scheduler's mixed step (two prefill chunks among decode tokens) launches the batched
    prefill kernels; each distinct launch compiles for sm_90 and sm_120."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    rec = tmp_path / "launches.json"
    proc = subprocess.run([sys.executable, "-m", "lab.bench.deepseek_v4.count_launches", "--layers", "SCH",
                           "--step", "mixed", "--record", str(rec)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distinct launches written" in proc.stdout
    _launches_compile(rec)
