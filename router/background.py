"""Fire-and-forget tasks the router must not lose: Abort RPCs sent while a request is cancelled.

A cancelled request cannot await its own clean-up (its scope is being torn down), so it hands the
Abort to `BackgroundTasks`, which keeps a reference until the task ends and waits for the rest at
shutdown.  This module must never let an exception escape a task silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("bulkhead.router.background")


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)

        def _done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("%s failed: %s", what, t.exception())

        task.add_done_callback(_done)

    async def close(self, timeout_s: float = 5.0) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for t in pending:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending, return_exceptions=True)
