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
    def __init__(self, capacity_bytes: int, device: torch.device | str,
                 arena: torch.Tensor | None = None) -> None:
        self.capacity = _align(max(capacity_bytes, _ALIGN))
        self.device = torch.device(device)
        if arena is None:
            arena = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        assert arena.dtype == torch.uint8 and arena.numel() >= self.capacity
        self._arena = arena
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

    def lane(self, nbytes: int, caller: str) -> Workspace:
        """A Workspace of its own over ``nbytes`` of this one's current frame (gone when the
        frame ends): the scratch of work issued to a second stream, which may run while this
        arena's later frames reuse the bytes its own frames released. Its frames never overlap
        this arena's; it is as fixed as this one (a request past its end raises, naming the
        caller), and this arena's peak counts it whole."""
        nbytes = _align(max(nbytes, _ALIGN))
        sub = Workspace(nbytes, self.device, self.take((nbytes,), torch.uint8, caller))
        sub.is_locked = self.is_locked
        return sub
