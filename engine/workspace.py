"""The per-step scratch arena: one buffer reserved at start-up from the memory plan.

Every per-step scratch buffer (attention tiles, logits, sampling buffers, kernel scratch) is a view
into it, taken in nested ``scope()`` frames (bump allocation, released when the frame ends). The
arena never grows: a request past its end raises ``WorkspaceExhausted`` naming the caller, before
and after ``lock()`` alike. ``lock()`` marks the end of warm-up; the high-water mark recorded up to
then is the measured peak the plan is checked against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine.errors import WorkspaceExhausted

_ALIGN = 256  # bytes; keeps every view aligned for vector loads and Triton kernels


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Workspace:
    def __init__(self, capacity_bytes: int, device: torch.device | str) -> None:
        self.capacity = _align(max(capacity_bytes, _ALIGN))
        self.device = torch.device(device)
        self._arena = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        self._offset = 0
        self._frames: list[int] = []
        self.peak_bytes = 0
        self.is_locked = False

    @property
    def available(self) -> int:
        return self.capacity - self._offset

    def lock(self) -> None:
        assert not self._frames, "lock() inside an open scope"
        self.is_locked = True

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._frames.append(self._offset)
        try:
            yield
        finally:
            self._offset = self._frames.pop()

    def take(self, shape: tuple[int, ...] | list[int], dtype: torch.dtype, caller: str) -> torch.Tensor:
        """A view of ``shape``/``dtype`` valid until the enclosing scope ends. Contents are
        undefined (not zeroed)."""
        assert self._frames, f"{caller}: Workspace.take outside a scope()"
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = self._offset
        end = start + _align(nbytes)
        if end > self.capacity:
            raise WorkspaceExhausted(caller, nbytes, self.capacity - start, self.capacity)
        self._offset = end
        if end > self.peak_bytes:
            self.peak_bytes = end
        return self._arena[start : start + nbytes].view(dtype).view(*shape)
