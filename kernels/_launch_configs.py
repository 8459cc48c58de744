"""Launch settings (``num_warps`` and tile sizes) of the small kernels of a decode step, by
kernel and by the rows of the launch, in one place: the launchers ask :func:`launch_config`,
and :func:`overridden` replaces a kernel's settings inside a ``with`` (what
``bench.deepseek_v4.decode_kernel_configs`` sweeps). A CUDA graph keeps the settings it was
captured with. Only settings that leave the results the same to rounding live here: the
sums run in another order, nothing else changes.

These kernels are bound by latency, not bytes: a reduction that spans warps goes through
shared memory and a barrier, a loop over a window is a chain of dependent loads, and a grid of
a few programs leaves most SMs idle (kernels/NOTES.md "Tiny reductions at decode").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# the settings each kernel takes (checked by ``overridden``)
KNOBS: dict[str, tuple[str, ...]] = {
    "moe_route": ("num_warps",),
    "compress_window": ("BLOCK_C", "BLOCK_W", "num_warps"),
    "compress_entry": ("num_warps",),
    "rope_norm": ("num_warps",),
    "topk_merge": ("num_warps",),
}

_OVERRIDES: dict[str, dict[str, int]] = {}


def _defaults(kernel: str, rows: int) -> dict[str, int]:
    if kernel == "compress_window":
        return {"BLOCK_C": 64, "BLOCK_W": 32, "num_warps": 4}
    return {"num_warps": 4}


def launch_config(kernel: str, rows: int) -> dict[str, int]:
    """The settings of ``kernel`` for a launch of ``rows`` rows (tokens): the defaults, then
    any :func:`overridden` values."""
    if kernel not in KNOBS:
        raise KeyError(f"no launch settings for kernel {kernel!r} (known: {sorted(KNOBS)})")
    return {**_defaults(kernel, rows), **_OVERRIDES.get(kernel, {})}


@contextmanager
def overridden(kernel: str, **settings: int) -> Iterator[None]:
    """Launches of ``kernel`` inside the ``with`` take ``settings`` over the defaults (each a
    name of ``KNOBS[kernel]``; ``num_warps`` a power of two, tiles powers of two >= 2)."""
    if kernel not in KNOBS:
        raise KeyError(f"no launch settings for kernel {kernel!r} (known: {sorted(KNOBS)})")
    for name, value in settings.items():
        if name not in KNOBS[kernel]:
            raise ValueError(f"{kernel} takes {KNOBS[kernel]}, not {name!r}")
        least = 1 if name == "num_warps" else 2
        if not isinstance(value, int) or value < least or value & (value - 1):
            raise ValueError(f"{kernel} {name} must be a power of two >= {least}, got {value!r}")
    before = _OVERRIDES.get(kernel)
    _OVERRIDES[kernel] = {**(before or {}), **settings}
    try:
        yield
    finally:
        if before is None:
            _OVERRIDES.pop(kernel, None)
        else:
            _OVERRIDES[kernel] = before
