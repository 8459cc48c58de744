"""The compile check's unit: one kernel at one compile-time configuration (``KernelSpec``).

Plain data that ``kernels.compile_check`` turns into a GPU compile; it never imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: object  # a triton JITFunction
    types: dict[str, str]  # argument -> triton type ("*bf16", "fp32", ...); others are i32
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 2




def ptr(dtype: str) -> str:
    """Triton's signature type of a pointer to ``dtype`` (``ptr("bf16")`` -> ``"*bf16"``)."""
    return "*" + dtype
