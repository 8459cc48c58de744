"""Live tensor bytes of a region of code, on any device: which storages an op creates, how many
bytes are alive at the peak, and which ops (and frames of ours) made the ones alive then.

A ``TorchDispatchMode`` sees every ATen op. An op whose output storage is none of its inputs'
storages made a new one (a factory, or a compute op writing a fresh result); a view, an
in-place or an ``out=`` op did not. Each new storage is watched through a weak reference (the
storage's Python object lives as long as its memory does), so its bytes leave the count when
the memory is freed. Storages made before the region (weights, KV pool, the Workspace's arena)
are not counted, and neither are views into them: what is counted is what a device's caching
allocator would hand out during the region, without its rounding. Diagnostic only: never used
by the engine.
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_OURS = ("/engine/", "/kernels/", "/bench/", "/lab/")


@dataclass(frozen=True)
class Allocation:
    nbytes: int
    op: str
    where: str  # the innermost frames of our code that led to the op
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as t: ...`` -> ``t.peak`` bytes alive at once, ``t.at_peak`` the
    allocations alive then (largest first), ``t.live`` now. ``stacks``: record where each
    allocation came from (slower); ``label``: tags the peak (see :meth:`mark`). ``probe``
    (optional) is read at every new peak into ``probe_at_peak``: e.g. the CUDA allocator's
    ``memory_allocated``, to tell whether it saw the same peak."""

    stacks: bool = True
    probe: Callable[[], int] | None = None
    probe_at_peak: int | None = None
    live: int = 0
    peak: int = 0
    at_peak: list[Allocation] = field(default_factory=list)
    peak_label: str = ""
    label: str = ""
    _alive: dict[int, tuple[Allocation, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def mark(self, label: str) -> None:
        """Tag the moments from here on (the peak reports the tag it was reached under)."""
        self.label = label

    def reset_peak(self) -> None:
        self.peak, self.at_peak, self.peak_label = self.live, self._snapshot(), self.label
        if self.probe is not None:
            self.probe_at_peak = self.probe()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        grew = False
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = _key(t)
            if key in inputs or key in self._alive:
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue
            where = _our_frames() if self.stacks else ""
            alloc = Allocation(st.nbytes(), str(func), where, tuple(t.shape), t.dtype)
            self._alive[key] = (alloc, weakref.ref(st, self._freed(key)))
            self.live += alloc.nbytes
            grew = True
        if grew and self.live > self.peak:
            self.reset_peak()
        return out

    def _freed(self, key: int) -> Any:
        def gone(_: Any) -> None:
            entry = self._alive.pop(key, None)
            if entry is not None:
                self.live -= entry[0].nbytes
        return gone

    def _snapshot(self) -> list[Allocation]:
        return sorted((a for a, _ in self._alive.values()), key=lambda a: -a.nbytes)

    def report(self, top: int = 40) -> str:
        """The allocations alive at the peak, largest first, one line each."""
        lines = [f"peak {self.peak:,} B ({self.peak / 2**20:.1f} MiB) at {self.peak_label!r}: "
                 f"{len(self.at_peak)} tensors"]
        for a in self.at_peak[:top]:
            lines.append(f"  {a.nbytes:>14,} B  {str(a.dtype)[6:]:<9} {list(a.shape)!s:<22} "
                         f"{a.op:<36} {a.where}")
        rest = self.at_peak[top:]
        if rest:
            lines.append(f"  {sum(a.nbytes for a in rest):>14,} B  in {len(rest)} smaller tensors")
        return "\n".join(lines)


def _key(t: torch.Tensor) -> int:
    """One storage's identity (its C++ object), shared by all its views."""
    return t.untyped_storage()._cdata


def _our_frames(depth: int = 3) -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if any(p in f.filename for p in _OURS)
              and f.filename != __file__]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}"
                      for f in reversed(frames[-depth:]))
