"""A background loop that runs one async step every interval and always stops when asked.

Cancelling a task is not enough to stop a loop whose step awaits a client with its own timeouts:
when the cancel lands in the same loop iteration as such a timeout, the client can turn the
CancelledError into a TimeoutError, the step handles it as one more failed beat, and the loop
runs on; an unbounded ``await task`` after ``cancel()`` then waits forever (seen with redis-py's
socket timeouts on Python 3.11). So ``stop()`` sets a flag the loop reads between steps, wakes
the wait between steps, cancels a step in flight, and waits a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Periodic:
    """Runs ``step()`` every ``interval_s`` seconds (after the previous step ends) until stop()."""

    def __init__(self, step: Callable[[], Awaitable[object]], interval_s: float,
                 what: str) -> None:
        if interval_s <= 0:
            raise ValueError(f"{what}: interval {interval_s} s must be > 0")
        self._step = step
        self.interval_s = interval_s
        self.what = what
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"{self.what} was already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.what)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
            if self._stopping.is_set():
                return
            try:
                await self._step()
            except Exception:  # a bug in one step must not end the loop
                log.exception("%s failed", self.what)

    async def stop(self, wait_s: float | None = None) -> bool:
        """Stop the loop; True once it has ended. Waits at most ``wait_s`` (default: 2 intervals
        plus one second) and never raises; a loop still running then is logged and abandoned."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is None or task.done():
            return True
        task.cancel()
        bound = 2 * self.interval_s + 1.0 if wait_s is None else wait_s
        done, _ = await asyncio.wait({task}, timeout=bound)
        if not done:
            log.warning("%s did not stop within %.1f s; abandoned", self.what, bound)
            return False
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s ended with %r", self.what, task.exception())
        return True
