"""Argument checks shared by the kernel wrappers: shapes, dtypes, devices, contiguity.

Every check raises ``KernelArgumentError`` naming the kernel and the argument. Checks only read
tensor metadata; they must never launch device work or allocate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.errors import KernelArgumentError


def check_tensor(
    kernel: str,
    name: str,
    t: torch.Tensor,
    *,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise unless ``t`` has ``len(shape)`` dims matching ``shape`` (None = any) and a listed dtype."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgumentError(kernel, name, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise KernelArgumentError(kernel, name, f"must have shape {wanted}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise KernelArgumentError(kernel, name, f"must have dtype in ({names}), got {t.dtype}")
    if t.device != device:
        raise KernelArgumentError(kernel, name, f"must be on {device}, got {t.device}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise KernelArgumentError(kernel, name, f"must have stride 1 in its last dim, got {t.stride()}")


def check_contiguous(kernel: str, name: str, t: torch.Tensor) -> None:
    """Raise unless ``t`` is contiguous (kernels that address it with one row stride need this)."""
    if not t.is_contiguous():
        raise KernelArgumentError(kernel, name, f"must be contiguous, got strides {t.stride()}")


def check_positive(kernel: str, name: str, value: int) -> None:
    if value <= 0:
        raise KernelArgumentError(kernel, name, f"must be > 0, got {value}")
