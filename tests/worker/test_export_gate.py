"""The prefill worker's export gate: prompts' KV in LMCache's pool never exceeds its size."""

from __future__ import annotations

import asyncio

import pytest

from prefill_worker.export_gate import ExportGate


def test_holders_never_exceed_the_capacity_and_all_get_through() -> None:
    async def run() -> tuple[int, list[str]]:
        gate, peak, order = ExportGate(100), 0, []

        async def put(name: str, nbytes: int, hold_s: float) -> None:
            nonlocal peak
            async with gate.hold(nbytes):
                peak = max(peak, gate.used)
                order.append(name)
                await asyncio.sleep(hold_s)

        await asyncio.wait_for(asyncio.gather(
            put("a", 60, 0.05), put("b", 60, 0.01), put("huge", 500, 0.01), put("c", 30, 0.0)),
            timeout=5)
        return peak, order

    peak, order = asyncio.run(run())
    assert peak <= 100
    assert order[0] == "a" and sorted(order) == ["a", "b", "c", "huge"]


def test_a_cancelled_waiter_or_holder_gives_its_bytes_back() -> None:
    async def run() -> int:
        gate = ExportGate(100)
        started = asyncio.Event()

        async def holder() -> None:
            async with gate.hold(80):
                started.set()
                await asyncio.sleep(30)

        h = asyncio.create_task(holder())
        await started.wait()
        waiter = asyncio.create_task(gate.hold(50).__aenter__())
        await asyncio.sleep(0.01)
        waiter.cancel()
        h.cancel()
        await asyncio.gather(h, waiter, return_exceptions=True)
        async with asyncio.timeout(1):
            async with gate.hold(100):
                return gate.used

    assert asyncio.run(run()) == 100


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive capacity"):
        ExportGate(0)


def test_a_wait_past_its_timeout_takes_nothing() -> None:
    async def run() -> tuple[int, int]:
        gate = ExportGate(100)
        held = await gate.acquire(90)
        with pytest.raises(TimeoutError):
            await gate.acquire(20, timeout_s=0.05)
        used_while_held = gate.used
        gate.release(held)
        async with gate.hold(100, timeout_s=1):
            return used_while_held, gate.used

    assert asyncio.run(run()) == (90, 100)
