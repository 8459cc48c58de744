"""The host memory that fetched KV waits in before the engine thread imports it: one arena of
fixed size made at start-up, taken a region per fetch.

Why an arena: a fetch used to allocate a fresh tensor of the prompt's size, so host memory grew
with the number and length of the prompts being fetched at once (a 128k-token Llama-3-8B prompt
is 16 GiB); several at once could take the host down with every worker on it. Here the total is
fixed; a fetch that does not fit waits for others to be imported, and a prompt larger than the
whole arena loads its leading part and the engine computes the rest.

The arena is ordinary (pageable) memory by default: the kernel backs its pages only as fetches
first touch them, so a worker that never fetches much never holds much, and a worker with a
staging of tens of GiB does not lock them at start-up. ``pin=True`` (the worker setting
``kv_staging_pinned``) page-locks it all at start-up, which lets the engine's host-to-device
copy of each import slice (engine/kv_import_job.py) run asynchronously at the bus's rate instead
of through the driver's bounce buffer; without CUDA there is nothing to pin for, and it is
ignored with a warning. Its gain has not been measured on a GPU yet.

A region is given back when the ``Region`` object is garbage (the engine imported it, or the
request ended first and dropped its import hook): nothing has to remember to free it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)
_ALIGN = 4096  # regions start on a page: recv_into and the DMA engine both like it


# How long a fetch waits for room in the host arena before its prompt is recomputed instead.
# The arena's holder is another prompt being fetched and imported: 15 s + 2.6 s for a 131k-token
# Llama-3-8B prompt on the H200 (2026-12-03), where a 10 s wait sent a 32k prompt to be
# recomputed by the decode worker (seconds of prefill among its decodes) 3 s before room came.
ARENA_WAIT_S = 30.0


class Region:
    """``data``: a uint8 host tensor of the bytes taken; the arena gets them back when this
    object is collected. Keep the Region (not only views of ``data``) alive while they are used."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self._release: weakref.finalize | None = None  # set by the arena that made it


class HostStaging:
    def __init__(self, nbytes: int, pin: bool = False) -> None:
        if nbytes <= 0:
            raise ValueError(f"host staging needs a positive size, got {nbytes} B")
        if pin and not torch.cuda.is_available():
            log.warning("kv_staging_pinned: no CUDA device, the host staging stays pageable")
            pin = False
        self.nbytes = nbytes
        self.pinned = pin
        self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._cond = threading.Condition()

    @property
    def free_bytes(self) -> int:
        with self._cond:
            return sum(size for _, size in self._free)

    def take(self, nbytes: int, timeout_s: float) -> Region | None:
        """A region of ``nbytes`` (at most the arena's size: ask for less first), waiting up to
        ``timeout_s`` for other fetches' regions to come back; None if none came in time."""
        if nbytes > self.nbytes:
            raise ValueError(f"a region of {nbytes} B is larger than the {self.nbytes} B arena")
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        need = min(need, self.nbytes)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i, (off, size) in enumerate(self._free):
                    if size >= need:
                        if size == need:
                            del self._free[i]
                        else:
                            self._free[i] = (off + need, size - need)
                        region = Region(self._buf[off:off + nbytes])
                        region._release = weakref.finalize(region, self._give_back, off, need)
                        return region
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("no room for %d B of fetched KV in the %.2f GiB host staging "
                                "within %.0f s: the prompt is recomputed", nbytes,
                                self.nbytes / 2**30, timeout_s)
                    return None
                self._cond.wait(left)

    def trim(self, region: Region, nbytes: int) -> None:
        """Keep only the first ``nbytes`` of ``region`` and give the rest back now: a fetch that
        read fewer chunks than it took room for (chunks evicted from the store between its
        lookup and its read) must not hold the arena for bytes it never filled, while its
        prompt's remaining tokens are computed."""
        release = region._release
        held = release.peek() if release is not None else None
        if held is None or held[1] != self._give_back:
            raise ValueError("trim: the region was not taken from this arena, or is released")
        off, size = held[2]
        keep = min(size, -(-max(nbytes, 1) // _ALIGN) * _ALIGN)
        if keep >= size:
            return
        release.detach()
        region.data = region.data[:nbytes]
        region._release = weakref.finalize(region, self._give_back, off, keep)
        self._give_back(off + keep, size - keep)

    def _give_back(self, off: int, size: int) -> None:
        with self._cond:
            self._free.append((off, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for o, s in self._free:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free = merged
            self._cond.notify_all()
