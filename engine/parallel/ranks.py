"""Rank 0's handle on the other ranks: spawns them, joins the group with them, watches them.

A rank that exits while the worker is serving leaves the model without its shard: no step can
complete any more. The watcher then ends the worker's process with ``RANK_DIED_EXIT`` (after
stopping the surviving ranks), so the supervisor and the router see a dead worker at once
instead of one that hangs in a collective. Followers watch rank 0 the same way
(``follower._exit_with_parent``).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.parallel.follower import follower_main
from engine.parallel.rank_group import Command, RankGroup
from engine.parallel.rank_runner import rank_device

log = logging.getLogger(__name__)

RANK_DIED_EXIT = 75  # the worker's exit status when one of its ranks died under it


class Ranks:
    """Starts ranks 1..size-1 and joins rank 0 to their group (blocks until all have joined)."""

    def __init__(self, ec: EngineConfig) -> None:
        self.size = ec.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="bulkhead-tp-")
        init_file = os.path.join(self._dir, "rendezvous")
        ctx = mp.get_context("spawn")
        threads = torch.get_num_threads()
        self.procs = [ctx.Process(target=follower_main,
                                  args=(ec, r, init_file, os.getpid(), threads),
                                  name=f"bulkhead-tp-rank{r}", daemon=True)
                      for r in range(1, self.size)]
        for p in self.procs:
            p.start()
        self._stopping = threading.Event()
        # At interpreter exit multiprocessing terminates the ranks: not a death to report.
        atexit.register(self._stopping.set)
        if self.procs:  # a group of one (a device test of the rank path) has none to watch
            threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()
        self.group = RankGroup(0, self.size, rank_device(ec, 0), init_file)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels))
        if self._stopping.is_set():
            return
        dead = sentinels[ready[0]]
        dead.join(1.0)  # its exit status
        log.error("tensor-parallel %s exited (status %s) under a serving worker; stopping the "
                  "worker", dead.name, dead.exitcode)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        os._exit(RANK_DIED_EXIT)

    def abort(self) -> None:
        """Start-up failed on rank 0: end the other ranks without a word."""
        self._stopping.set()
        for p in self.procs:
            p.terminate()
            p.join(5.0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to stop and wait for them (the engine's shutdown)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.group.send(Command("stop"))
        except RuntimeError as exc:  # a rank already gone: nothing left to tell
            log.warning("tensor-parallel stop: %s", exc)
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()
        self.group.close()
        shutil.rmtree(self._dir, ignore_errors=True)
