"""Typed errors raised by the kernel wrappers when a caller hands them unusable arguments.

Each error names the argument and the limit it broke, so a caller can fix the call without
reading the kernel. This module must never import torch, triton or anything of ours.
"""

from __future__ import annotations


class KernelArgumentError(ValueError):
    """An argument of a kernel wrapper has the wrong shape, dtype, device, stride or size."""

    def __init__(self, kernel: str, argument: str, problem: str) -> None:
        super().__init__(f"{kernel}: argument '{argument}' {problem}")
        self.kernel = kernel
        self.argument = argument


class KernelUnavailableError(RuntimeError):
    """The Triton path cannot run here (no triton, or CPU tensors without TRITON_INTERPRET=1)."""
