"""A second stream for a step's independent work, planned like the first.

A decode step at small batch is a chain of short kernels, each leaving most of the GPU idle
(lab/results/notebook.md: ~50 a layer, a few microseconds each). Work that does not depend on the
main chain (a block's side projections, a shared expert beside the routed ones) can run beside
it on a second stream; captured in a CUDA graph, the fork and join become graph edges and the
two branches run at once.

The incident this project answers (README: an operator's report on a sparse-attention model) lost
its engine to exactly this shape of work: a second lane whose scratch was not planned, two streams'
intermediates live at once, buffers released on one stream while the other still read them. So
a lane here is bounded the same way the main one is:

* **Scratch**: the side's kernels take their scratch from a Workspace of its own, carved out of
  the step's frame of the main Workspace (``Workspace.lane``) at a planned size: its frames can
  never overlap the frames the main stream takes and releases meanwhile.
* **Counters and other per-kernel state** (split-K semaphores) are the side's own: the caller
  binds them for the side's work (``bind``) and they are restored when that work returns.
* **Lifetimes**: every fork is joined (the main stream waits for the side) before the main
  stream issues anything that reads the side's results, and the caller keeps the main
  stream's tensors the side reads alive until the join (``keep``), so the caching allocator
  never hands their blocks to later main-stream work while the side may still read them. The
  side's own allocations are made on the side stream, whose blocks the allocator gives to no
  other stream.
* **Shared memoisation**: state the two lanes share (a step's per-step addressing, computed on
  first use) must be computed before the fork; ``frozen`` snapshots it and side work that
  creates new entries raises, naming them (that entry would be made on one stream and read on
  the other without an edge between them).

Without CUDA (the CPU tier, the Triton interpreter) a lane has no stream: the side's work runs
in issue order on the one stream, or (``defer``, a test schedule) at the join, after the main
stream's work meanwhile. The bindings, the scratch carve-out and the checks above run all the
same, so the tests exercise the bookkeeping and the ordering that the GPU relies on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch


class SideLane:
    """One side stream (CUDA) or none (issue order), with fork / join bookkeeping.

    ``defer`` (no CUDA only; tests): the other extreme of the schedules a GPU may pick. Each
    piece of side work runs at the join instead of where it is issued, so the main stream's
    work between the fork and the join runs first. The eager order runs the side first. A
    decode step that gives the same results under both reads nothing across the lanes
    without the fork or join that orders it."""

    def __init__(self, device: torch.device, defer: bool = False) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if defer and self.stream is not None:
            raise ValueError("SideLane(defer=True) is a CPU test schedule")
        self.defer = defer
        self._open = False  # side work not yet joined
        self._keep: list[Any] = []
        self._queue: list[tuple[Callable[[], None], Callable[[], Callable[[], None]] | None,
                                Callable[[], Any] | None]] = []

    def run(self, fn: Callable[[], None], bind: Callable[[], Callable[[], None]] | None = None,
            frozen: Callable[[], Any] | None = None, keep: tuple[Any, ...] = ()) -> None:
        """Issue ``fn()`` to the side stream, after everything issued so far on the current
        stream (a second run before the join continues the side's work from there: it waits
        for the main stream's progress since). ``bind()`` points the side's modules at its
        scratch and counters and returns the function that restores them (run when ``fn``
        returns). ``frozen()``: a snapshot of shared memoised state, which ``fn`` must not
        change. ``keep``: main-stream tensors the side reads, held until :meth:`join`."""
        self._open = True
        self._keep.extend(keep)
        if self.defer:
            self._queue.append((fn, bind, frozen))
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._call(fn, bind, frozen)

    def _call(self, fn: Callable[[], None], bind: Callable[[], Callable[[], None]] | None,
              frozen: Callable[[], Any] | None) -> None:
        before = frozen() if frozen is not None else None
        restore = bind() if bind is not None else None
        try:
            with torch.cuda.stream(self.stream) if self.stream is not None \
                    else contextlib.nullcontext():
                fn()
        finally:
            if restore is not None:
                restore()
        if frozen is not None:
            after = frozen()
            if after != before:
                raise RuntimeError(
                    "SideLane.run: the side's work created shared state that the main stream "
                    f"may read without waiting for it ({sorted(map(str, set(after) - set(before)))}); "
                    "compute it before the fork")

    def begin(self) -> None:
        """Start of a step: side work a failed step left unjoined is dropped (deferred) or
        joined (issued)."""
        self._queue = []
        if self._open:
            self.join()

    def join(self) -> None:
        """The main stream waits for everything issued to the side so far (deferred: the side
        work runs now); the kept tensors are released. Nothing to do with no side work open
        (a second join is harmless)."""
        if not self._open:
            return
        queue, self._queue = self._queue, []
        for fn, bind, frozen in queue:
            self._call(fn, bind, frozen)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._open = False
        self._keep = []

    def close(self) -> None:
        """End of the step: all side work must have been joined (a CUDA graph capture fails
        on an unjoined stream; eagerly, the next step would race the side)."""
        if self._open:
            raise RuntimeError("SideLane: side work was never joined")
