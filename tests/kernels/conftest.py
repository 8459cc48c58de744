"""Kernel tests: the CPU tier runs the Triton kernels through the interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here at collection
time when no CUDA device is present. On a GPU machine the `gpu` tier compiles for real.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_INTERPRET_OK = os.environ.get("TRITON_INTERPRET") == "1" and (
    "triton" not in sys.modules or not torch.cuda.is_available()
)


@pytest.fixture
def interpret() -> None:
    """Skip unless Triton kernels can run on CPU tensors here (interpreter mode)."""
    pytest.importorskip("triton")
    if not _INTERPRET_OK:
        pytest.skip("CPU tier needs TRITON_INTERPRET=1 set before triton is imported")


@pytest.fixture
def cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("gpu tier must not run under TRITON_INTERPRET=1")
