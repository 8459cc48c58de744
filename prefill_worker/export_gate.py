"""How many prompts' KV may be on their way into the store at once.

LMCache copies a prompt's KV into its CPU pool (``kv_staging_gb``) and writes it to Redis in the
background; the pool space comes back only when the write is done. A second long prompt put
while the first is still being written finds the pool full, and LMCache then stores what fits
and drops the rest with a log line: on the H200 (2026-12-03) a 32k prompt put behind two 128k
ones kept 7,936 of its 32,784 tokens, and the decode side would have recomputed the other 25k.

So the prefill worker holds a prompt's bytes of this gate from the put until the store shows the
prompt (or the wait ends). The prompt's blocks stay in the worker's own KV extent while it waits
(they are reserved already, so this costs no memory the plan does not hold), and the engine
thread is never the one that waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ExportGate:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"the export gate needs a positive capacity, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.used = 0
        self._cond = asyncio.Condition()
        self._wakers: set[asyncio.Task[None]] = set()

    async def acquire(self, nbytes: int, timeout_s: float | None = None) -> int:
        """Wait until ``nbytes`` fit beside what other prompts hold (a prompt larger than the
        whole pool waits for it to be empty) and take them; returns what to ``release``.
        ``TimeoutError`` if no room came within ``timeout_s`` (nothing is taken then)."""
        need = min(max(nbytes, 0), self.capacity)
        async with asyncio.timeout(timeout_s), self._cond:
            await self._cond.wait_for(lambda: self.used + need <= self.capacity)
            self.used += need
        return need

    def release(self, taken: int) -> None:
        """Give back what ``acquire`` returned. Synchronous, so a cancelled holder cannot keep
        its bytes; the waiters are woken by a task of the loop."""
        self.used -= taken
        task = asyncio.get_running_loop().create_task(self._wake())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    @asynccontextmanager
    async def hold(self, nbytes: int, timeout_s: float | None = None) -> AsyncIterator[None]:
        taken = await self.acquire(nbytes, timeout_s)
        try:
            yield
        finally:
            self.release(taken)

    async def _wake(self) -> None:
        async with self._cond:
            self._cond.notify_all()
