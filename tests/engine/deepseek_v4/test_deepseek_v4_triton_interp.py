"""The Triton kernels (through the interpreter on CPU) as the model's backend, scratch from a
locked engine Workspace sized by ``deepseek_v4_workspace_bytes``: same hidden states as the torch
backend on a step that holds two sequences."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_backend_under_triton_interpreter() -> None:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_triton_interp_check.py"))],
                          env=env, capture_output=True, text=True, timeout=240, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"maxdiff=(\S+) unfused_maxdiff=(\S+) ws_peak=(\d+) ws_cap=(\d+)", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) < 1e-4  # the fused decode step (step/decode_step.py, fused)
    assert float(m.group(2)) < 1e-4
    assert 0 < int(m.group(3)) <= int(m.group(4))
    dec = re.search(r"fused_decode_maxdiff=(\S+)", proc.stdout)
    assert dec and float(dec.group(1)) < 1e-4, proc.stdout
