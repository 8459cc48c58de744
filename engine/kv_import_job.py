"""Copying fetched KV into a sequence's blocks a bounded slice per engine step.

Why: the engine thread is the one that copies an imported prompt's KV from host memory into its
blocks, and every running decode waits while it does. In one go a 128k-token Llama-3-8B prompt
(16 GiB) would stall them all for ~2.3 s at the ~7 GB/s a pageable host copy reaches. Here each
engine step copies at most ``EngineConfig.kv_import_slice_bytes`` (whole blocks), all imports
together, in arrival order, before the step's forward; the importing sequence holds its blocks
and cache slot from admission on (nothing it needs can fail to be allocated mid-import) but gets
no chunk until its last slice is in (the scheduler skips it while ``is_importing``).

The copy: a slice goes host -> the planned device buffer (``non_blocking``: asynchronous when the
host rows are page-locked, an ordinary copy otherwise) -> the blocks (the layout's
``import_blocks``, a device-side scatter), all on the engine's stream, so the next slice's copy
into the same buffer and any later kernel that reads or reuses the blocks are ordered after it.
The host side is the one thing the stream does not protect: the staged rows (and the host staging
region they lie in) are kept until an event recorded after the job's last copy has completed,
also when the request is cancelled, times out or is preempted mid-import.

Never: allocates device memory of its own (the buffer is the plan's ``kv_import_slice`` term,
made at start-up), empties the allocator's cache, or lets the host region go while a copy may
still read it. Nothing here fails a request: a copy that raises imports nothing and the engine
computes the prompt instead.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from engine.kv_layout import KVLayout
from engine.scheduler import KVLoad
from engine.staged_kv import StagedKV

log = logging.getLogger(__name__)

# A one-shot import hook: fills the leading tokens' KV at once and says how many (the engine's
# KVImport protocol, engine/model_runner.py); kept for callers that copy blocks themselves.
Hook = Callable[..., int]


class ImportJob(ABC):
    """One sequence's import. ``advance`` copies at most ``max_blocks`` blocks and returns how
    many it copied; ``filled`` is the number of leading tokens in the blocks once ``done``."""

    done: bool = False
    filled: int = 0
    load: KVLoad

    @abstractmethod
    def advance(self, max_blocks: int) -> int: ...

    def release(self) -> Any:
        """Give up what the job holds on the host; returned for the caller to keep alive
        until the device has finished reading it."""
        return None


class HookImport(ImportJob):
    """A callable hook (tests, benchmarks): runs whole in one step, whatever the bound."""

    def __init__(self, hook: Hook, kv: Any, load: KVLoad) -> None:
        self.hook, self.kv, self.load = hook, kv, load

    def advance(self, max_blocks: int) -> int:
        ld = self.load
        self.filled = int(self.hook(self.kv, list(ld.block_ids), ld.num_prompt_tokens,
                                    num_computed_tokens=ld.num_computed_tokens))
        self.done = True
        self.hook = None  # what the hook closed over (a fetch's host memory) goes now
        return 0


class SlicedImport(ImportJob):
    """Staged host rows copied into the blocks over as many steps as the byte bound asks."""

    def __init__(self, staged: StagedKV, layout: KVLayout, kv: Any, load: KVLoad,
                 buffer: torch.Tensor | None) -> None:
        bs = layout.block_size
        self.staged: StagedKV | None = staged
        self.layout, self.kv, self.load, self.buffer = layout, kv, load, buffer
        self.block_ids = list(load.block_ids)
        self.num_tokens = min(staged.num_tokens, load.num_prompt_tokens)
        # blocks the prefix cache already filled (maybe shared) are never written
        self.next_block = -(-load.num_computed_tokens // bs)
        self.end_block = min(self.num_tokens // bs, staged.num_blocks)
        self.num_slices = 0
        self.bytes_copied = 0
        self.copy_s = 0.0  # engine-thread time spent issuing this job's copies
        self.started = time.monotonic()
        if self.next_block >= self.end_block:
            self._finish()

    def advance(self, max_blocks: int) -> int:
        assert not self.done and self.staged is not None and max_blocks >= 1
        t0 = time.perf_counter()
        i = self.next_block
        j = min(self.end_block, i + max_blocks)
        rows = self.staged.blocks[i:j]  # [j - i, bytes_per_block] uint8 on the host
        if self.buffer is not None:
            dst = self.buffer[: j - i]
            dst.copy_(rows, non_blocking=True)  # async from page-locked rows; ordered on the stream
            rows = dst
        self.layout.import_blocks(self.kv, self.block_ids[i:j], rows)
        self.next_block = j
        self.num_slices += 1
        self.bytes_copied += rows.shape[0] * rows.shape[1]
        if j == self.end_block:
            self._finish()
        self.copy_s += time.perf_counter() - t0
        return j - i

    def _finish(self) -> None:
        staged, bs = self.staged, self.layout.block_size
        assert staged is not None
        end = min(self.end_block * bs, self.num_tokens)
        start = self.load.num_computed_tokens
        if staged.resume is not None and start < staged.resume_end <= end:
            # after the blocks: importing a block drops the resume state kept at its end
            self.layout.import_resume_state(self.kv, self.block_ids[staged.resume_end // bs - 1],
                                            staged.resume)
        # a layout may resume only at some block ends (those with saved side state)
        self.filled = self.layout.resumable_tokens(self.kv, self.block_ids, end)
        self.done = True

    def release(self) -> Any:
        staged, self.staged = self.staged, None
        return staged


class KVImporter:
    """The engine's imports: waiting for their sequence's admission, then in progress (started
    with the scheduler's KVLoad, advanced once per step within the step's byte bound, finished
    or cancelled); host memory parked until the device is done."""

    def __init__(self, layout: KVLayout, kv: Any, slice_bytes: int,
                 buffer: torch.Tensor | None, granularity: int = 1) -> None:
        """``buffer``: [slice_blocks, bytes_per_block] uint8 on the KV's device, or None to hand
        ``import_blocks`` the host rows (a layout that moves them to its ranks itself).
        ``granularity``: tokens a sequence can resume at a multiple of (results round down)."""
        self.layout, self.kv, self.buffer = layout, kv, buffer
        self.granularity = granularity
        self.slice_blocks = max(1, slice_bytes // layout.bytes_per_block)
        if buffer is not None:
            self.slice_blocks = min(self.slice_blocks, buffer.shape[0])
        self.cuda = isinstance(buffer, torch.Tensor) and buffer.is_cuda
        self._waiting: dict[str, StagedKV | Hook] = {}  # their sequence not yet admitted
        self._jobs: dict[str, ImportJob] = {}  # in arrival order
        self._parked: list[tuple[Any, Any]] = []  # (event after the last copy, host holder)
        self.blocks_copied = 0  # over the engine's life: progress, for the liveness counters

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    @property
    def num_parked(self) -> int:
        """Host holders still waiting for their copies to complete (tests, diagnostics)."""
        return len(self._parked)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, request_id: str, source: StagedKV | Hook) -> None:
        """What ``request_id`` imports once the scheduler admits it (``start_loads``)."""
        self._waiting[request_id] = source

    def start_loads(self, loads: list[KVLoad]) -> list[str]:
        """Start the imports of a step's admitted sequences; -> those that have none any more
        (preempted mid-import and re-admitted in this very step: they load 0 tokens). The
        import runs once: its source, and the host memory holding what it fetched, go when its
        last slice is in rather than when the request ends."""
        gone = []
        for load in loads:
            source = self._waiting.pop(load.request_id, None)
            if source is None:
                gone.append(load.request_id)
            else:
                self.start(load, source)
        return gone

    def start(self, load: KVLoad, source: StagedKV | Hook) -> None:
        assert load.request_id not in self._jobs, load.request_id
        if isinstance(source, StagedKV):
            job: ImportJob = SlicedImport(source, self.layout, self.kv, load, self.buffer)
        else:
            job = HookImport(source, self.kv, load)
        self._jobs[load.request_id] = job

    def step(self) -> dict[str, int]:
        """Copy up to one step's bound of blocks, oldest import first; returns the leading
        tokens each import finished in this step filled, at most its load's ``max_tokens`` and
        rounded down to where the layout can resume (0: compute them all)."""
        self._drop_parked()
        budget = self.slice_blocks
        finished: dict[str, int] = {}
        for rid, job in list(self._jobs.items()):
            if not job.done:
                if budget <= 0:
                    break
                try:
                    copied = job.advance(budget)
                    budget -= copied
                    self.blocks_copied += copied
                except Exception as exc:  # never let an import take the engine thread down
                    log.error("KV import of %s failed, recomputing: %s", rid, exc)
                    job.done, job.filled = True, 0
            if job.done:
                g = self.granularity
                finished[rid] = min(job.filled, job.load.max_tokens) // g * g
                self._log(rid, job)
                self._park(self._jobs.pop(rid))
        return finished

    def cancel(self, request_id: str) -> bool:
        """The request ended or was preempted (it recomputes): its import goes, waiting or
        running; a running one stops copying and its host memory goes once the copies already
        issued have completed. False if it had no import running."""
        self._waiting.pop(request_id, None)
        job = self._jobs.pop(request_id, None)
        if job is None:
            return False
        if isinstance(job, SlicedImport) and not job.done:
            log.info("KV import of %s cancelled after %d of %d blocks (%d slice(s))",
                     request_id, job.next_block, job.end_block, job.num_slices)
        self._park(job)
        return True

    def _park(self, job: ImportJob) -> None:
        holder = job.release()
        if holder is None:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()  # after every copy this job issued on the engine's stream
        self._parked.append((event, holder))
        self._drop_parked()

    def _drop_parked(self) -> None:
        # the host region goes back to the arena when its last reference here is dropped
        self._parked = [(e, h) for e, h in self._parked if e is not None and not e.query()]

    def _log(self, rid: str, job: ImportJob) -> None:
        if not isinstance(job, SlicedImport):
            return
        log.info("KV import of %s: %d tokens in %d slice(s), %.1f MiB, %.1f ms from first to "
                 "last slice (%.1f ms copying on the engine thread)", rid, job.filled,
                 job.num_slices, job.bytes_copied / 2**20,
                 1e3 * (time.monotonic() - job.started), 1e3 * job.copy_s)
