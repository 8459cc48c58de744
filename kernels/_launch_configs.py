"""Launch settings (``num_warps`` and tile sizes) of the small kernels of a decode step, by
kernel and by the rows of the launch, in one place: the launchers ask :func:`launch_config`,
and :func:`overridden` replaces a kernel's settings inside a ``with`` (what
``lab.bench.deepseek_v4.decode_kernel_configs`` sweeps), as ``BULKHEAD_LAUNCH`` in the environment
does for a whole process (to time a setting in a full model). A CUDA graph keeps the settings
it was captured with. Only settings that leave the results the same to rounding live here: the
sums run in another order, nothing else changes.

These kernels are bound by latency, not bytes: a reduction that spans warps goes through
shared memory and a barrier, a loop over a window is a chain of dependent loads, and a grid of
a few programs leaves most SMs idle (kernels/NOTES.md "Tiny reductions at decode").
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

# the settings each kernel takes (checked for ``overridden`` and ``BULKHEAD_LAUNCH``)
KNOBS: dict[str, tuple[str, ...]] = {
    "moe_route": ("num_warps",),
    "moe_router": ("BLOCK_G", "BLOCK_H", "num_warps"),
    "compress_window": ("BLOCK_C", "BLOCK_W", "num_warps"),
    "compress_entry": ("num_warps",),
    "rope_norm": ("num_warps",),
    "topk_merge": ("num_warps",),
}

_OVERRIDES: dict[str, dict[str, int]] = {}
ENV = "BULKHEAD_LAUNCH"  # e.g. "compress_window:BLOCK_C=16,num_warps=2;moe_route:num_warps=1"


def _defaults(kernel: str, rows: int, size: int) -> dict[str, int]:
    """H100, one token to 32 (``lab.bench.deepseek_v4.decode_kernel_configs``, lab/results/notebook.md
    "Fifteenth session"); ``size``: the compressor's window rows, a rope_norm row's width."""
    if kernel == "compress_window":  # a long window: wide channel slices over 4 warps
        return ({"BLOCK_C": 32, "BLOCK_W": 128, "num_warps": 4} if size > 16 else
                {"BLOCK_C": 16, "BLOCK_W": 128, "num_warps": 1})
    if kernel == "compress_entry":
        return {"num_warps": 4 if size > 16 else 1}
    if kernel == "moe_router":  # experts a program, hidden a loop step
        return {"BLOCK_G": 2, "BLOCK_H": 1024, "num_warps": 1}
    if kernel == "moe_route":
        return {"num_warps": 1}
    if kernel == "rope_norm":
        return {"num_warps": 1 if size <= 512 else 4}
    if kernel == "topk_merge":
        return {"num_warps": 8}
    return {"num_warps": 4}


def _check(kernel: str, settings: dict[str, int], where: str) -> None:
    if kernel not in KNOBS:
        raise KeyError(f"{where}no launch settings for kernel {kernel!r} (known: {sorted(KNOBS)})")
    for name, value in settings.items():
        if name not in KNOBS[kernel]:
            raise ValueError(f"{where}{kernel} takes {KNOBS[kernel]}, not {name!r}")
        least = 1 if name == "num_warps" else 2
        if not isinstance(value, int) or value < least or value & (value - 1):
            raise ValueError(f"{where}{kernel} {name} must be a power of two >= {least}, "
                             f"got {value!r}")


@functools.lru_cache(maxsize=8)
def parse_env(raw: str) -> dict[str, dict[str, int]]:
    """``BULKHEAD_LAUNCH``'s value -> {kernel: {knob: value}}: "kernel:knob=v,knob=v" items
    joined by ";"; every name and value checked (a typo is an error, not a silent default)."""
    out: dict[str, dict[str, int]] = {}
    for item in raw.split(";"):
        if not item.strip():
            continue
        kernel, sep, knobs = item.partition(":")
        where = f"{ENV}={raw!r}: "
        if not sep:
            raise ValueError(f"{where}{item!r} is not kernel:knob=value,...")
        settings: dict[str, int] = {}
        for kv in knobs.split(","):
            name, eq, value = kv.partition("=")
            if not eq or not value.strip().isdigit():
                raise ValueError(f"{where}{kv!r} is not knob=integer")
            settings[name.strip()] = int(value)
        _check(kernel.strip(), settings, where)
        out.setdefault(kernel.strip(), {}).update(settings)
    return out


def launch_config(kernel: str, rows: int, size: int = 0) -> dict[str, int]:
    """The settings of ``kernel`` for a launch of ``rows`` rows (tokens; ``size`` as in
    ``_defaults``): the defaults, then ``BULKHEAD_LAUNCH``'s (read at every launch, so it must
    be set before graphs are captured), then any :func:`overridden` values."""
    _check(kernel, {}, "")
    env = parse_env(os.environ.get(ENV, "")).get(kernel, {})
    return {**_defaults(kernel, rows, size), **env, **_OVERRIDES.get(kernel, {})}


@contextmanager
def overridden(kernel: str, **settings: int) -> Iterator[None]:
    """Launches of ``kernel`` inside the ``with`` take ``settings`` over the defaults (each a
    name of ``KNOBS[kernel]``; ``num_warps`` a power of two, tiles powers of two >= 2)."""
    _check(kernel, settings, "")
    before = _OVERRIDES.get(kernel)
    _OVERRIDES[kernel] = {**(before or {}), **settings}
    try:
        yield
    finally:
        if before is None:
            _OVERRIDES.pop(kernel, None)
        else:
            _OVERRIDES[kernel] = before
