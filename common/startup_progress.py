"""Start-up progress of a worker, told on its console and read back by ``bulkhead up``.

A worker spends most of its start loading weights and running the warm-up steps of its memory
plan; on a small CPU machine that is tens of seconds in which nothing else is printed. The worker
prints one line per step (``StartupProgress``), prefixed so that ``bulkhead up``, which sends
each child's output to a log file, can pick those lines out of the log (``ProgressFollower``)
and show them on its own console. Plain text on stdout is the whole contract: no socket, no
file format. This module never imports torch (``bulkhead up`` stays light).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

PREFIX = "bulkhead-startup:"


class StartupProgress:
    """A callable that prints ``PREFIX <step> [+<seconds since start> s]`` and flushes."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out
        self._t0 = time.monotonic()

    def __call__(self, step: str) -> None:
        out = self._out or sys.stdout
        print(f"{PREFIX} {step} [+{time.monotonic() - self._t0:.1f} s]", file=out, flush=True)


class ProgressFollower:
    """Reads a log file from where it stopped last time and returns the progress steps in it.

    Only whole lines are read: a line still being written is left for the next call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new_steps(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []  # not created yet
        end = data.rfind(b"\n") + 1
        self._offset += end
        steps = []
        for raw in data[:end].splitlines():
            line = raw.decode(errors="replace")
            at = line.find(PREFIX)
            if at >= 0:
                steps.append(line[at + len(PREFIX):].strip())
        return steps
