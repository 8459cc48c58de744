"""`bulkhead up` sums what its workers planned from their start-up lines, in start order."""

from __future__ import annotations

from common.planned_memory import PlannedMemory


def test_the_sum_of_the_workers_plans_and_pools() -> None:
    planned = PlannedMemory()
    for role, step in [
        ("decode", "memory plan: 1,402 MiB of a 22,177 MiB budget, max_context 4,096, ..."),
        ("prefill", "memory plan: 402 MiB of a 22,177 MiB budget, max_context 4,096, ..."),
        ("prefill", "warm-up done, connecting the KV store through LMCache"),
        ("decode", "KV store connected: redis://127.0.0.1:6379, LMCache pool 10 MiB"),
        ("prefill", "KV store connected: redis://127.0.0.1:6379, LMCache pool 99 MiB"),
    ]:
        planned.read(role, step)
    assert planned.total_mib == 1402 + 402 + 10 + 99
    assert planned.summary().startswith(
        "planned 1,913 MiB in all (prefill 402 MiB + LMCache pool 99 MiB, decode 1,402 MiB + "
        "LMCache pool 10 MiB)")


def test_a_worker_without_a_store_has_no_pool_term() -> None:
    planned = PlannedMemory()
    planned.read("decode", "memory plan: 402 MiB of a 22,177 MiB budget")
    assert planned.summary().startswith("planned 402 MiB in all (decode 402 MiB)")
