"""Worker health from GetInfo polls: a slow answer is not a dead worker, a refused one is."""

from __future__ import annotations

import asyncio

from router.registry import MAX_MISSED_POLLS, StaticRegistry
from router.worker_client import CallDeadlines
from tests.router.router_fakes import FakeWorker, start_worker


async def test_missed_poll_deadlines_tolerated_then_counted():
    worker = FakeWorker(role="decode", script=[5, 6], eos_id=2)
    server = await start_worker(worker)
    reg = StaticRegistry([], [worker.address], CallDeadlines(0.2, 5.0, 5.0, 5.0), 3600.0)
    try:
        await reg.refresh()
        assert [w.healthy for w in reg.loads()] == [True]
        worker.info_delay_s = 0.5  # busy: every poll misses its deadline
        for _ in range(MAX_MISSED_POLLS - 1):
            await reg.refresh()
            assert [w.healthy for w in reg.loads()] == [True]
        await reg.refresh()
        assert [w.healthy for w in reg.loads()] == [False]
        worker.info_delay_s = 0.0
        await reg.refresh()
        assert [w.healthy for w in reg.loads()] == [True]
    finally:
        await reg.stop()
        await server.stop(0)
        await asyncio.sleep(0)


async def test_refused_connection_counts_at_once():
    worker = FakeWorker(role="decode", script=[5], eos_id=2)
    server = await start_worker(worker)
    reg = StaticRegistry([], [worker.address], CallDeadlines(0.5, 5.0, 5.0, 5.0), 3600.0)
    try:
        await reg.refresh()
        assert [w.healthy for w in reg.loads()] == [True]
        await server.stop(0)
        await reg.refresh()
        assert [w.healthy for w in reg.loads()] == [False]
    finally:
        await reg.stop()
