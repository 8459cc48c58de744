"""Where the Triton path may run, and the small helpers every launcher shares.

Triton is imported lazily here so ``import kernels`` works without it (the CPU engine uses the
PyTorch references). The environment variables the kernels read, TRITON_INTERPRET and
BULKHEAD_PDL, are read here and nowhere else. This module must never launch a kernel itself.
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


_PDL_DEVICES: dict[int, bool] = {}  # device index -> griddepcontrol available


def _gdc_importable() -> bool:
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except Exception:  # noqa: BLE001  (an older triton: launch without PDL)
        return False
    return True


PDL_WAIT = 1  # wait on the previous kernel first thing (every PDL kernel)
PDL_TRIGGER = 2  # then let the next kernel launch, its programs waiting while this one runs
PDL_PREFETCH = 4  # a weight-streaming kernel asks L2 for its weight slice before it waits
_PDL_WORDS = {"trigger": PDL_TRIGGER, "prefetch": PDL_PREFETCH}
PDL_DEFAULT = PDL_WAIT


def pdl_mode() -> int:
    """The ``PDL`` bits from ``BULKHEAD_PDL`` (read at every call, so a process can change it
    before it captures its graphs): unset or "1" the default, "0" off, else words joined by
    "," or "+" from "trigger" and "prefetch" ("wait" is always on). See kernels/NOTES.md."""
    raw = os.environ.get("BULKHEAD_PDL", "").strip().lower()
    if raw in ("", "1"):
        return PDL_DEFAULT
    if raw == "0":
        return 0
    mode = PDL_WAIT
    for word in raw.replace("+", ",").split(","):
        word = word.strip()
        if word in ("", "wait"):
            continue
        if word not in _PDL_WORDS:
            raise ValueError(f"BULKHEAD_PDL={raw!r}: {word!r} is not one of 0, 1, wait, "
                             f"{', '.join(_PDL_WORDS)}")
        mode |= _PDL_WORDS[word]
    return mode


def pdl_launch(device: torch.device) -> bool:
    """True when a kernel on ``device`` is to be launched with programmatic dependent launch
    (``launch_pdl=True``, its ``PDL`` constexpr set: ``pdl_wait(PDL)`` first thing): a CUDA
    device of compute capability 9 or more (Hopper, Blackwell), not under the interpreter, a
    triton that has ``gdc_wait``, and ``BULKHEAD_PDL`` not "0". See kernels/NOTES.md."""
    if device.type != "cuda" or interpreting() or pdl_mode() == 0:
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    ok = _PDL_DEVICES.get(index)
    if ok is None:
        ok = _gdc_importable() and torch.cuda.get_device_capability(index)[0] >= 9
        _PDL_DEVICES[index] = ok
    return ok


def pdl_kwargs(device: torch.device) -> dict[str, int | bool]:
    """The launch keywords of a kernel with a ``PDL`` constexpr: ``PDL`` (the bits of
    :func:`pdl_mode`) and ``launch_pdl=True`` where :func:`pdl_launch` says so, else none (the
    interpreter never sees ``launch_pdl``; the kernel's ``PDL=0`` default applies)."""
    return {"PDL": pdl_mode(), "launch_pdl": True} if pdl_launch(device) else {}


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
