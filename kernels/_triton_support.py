"""Where the Triton path may run, and the small helpers every launcher shares.

Triton is imported lazily here so ``import kernels`` works without it (the CPU engine uses the
PyTorch references). The one environment variable we read, TRITON_INTERPRET, is read here and
nowhere else. This module must never launch a kernel itself.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels.errors import KernelUnavailableError


def triton_available() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(kernel: str, device: torch.device) -> None:
    """Raise KernelUnavailableError unless a Triton kernel can run on ``device``."""
    if not triton_available():
        raise KernelUnavailableError(f"{kernel}: triton is not installed; use {kernel}_ref on CPU")
    if device.type == "cpu" and not interpreting():
        raise KernelUnavailableError(
            f"{kernel}: CPU tensors need TRITON_INTERPRET=1 (set before triton is imported); "
            f"otherwise call {kernel}_ref"
        )


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
