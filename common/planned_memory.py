"""The host or device memory a deployment's workers planned, summed from their start-up steps.

Each worker tells its memory plan's total and its LMCache pool in its start-up progress lines
(``memory plan: N MiB ...``, ``KV store connected: ..., LMCache pool N MiB``;
engine/llm_engine.py, worker/worker_base.py); ``bulkhead up`` reads them back and prints the sum,
so the figure it prints is the one each worker planned, not an estimate of its own. The
processes' own runtime (Python, torch, LMCache) is no term of any plan and is not counted here.
Never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_PLAN = re.compile(r"^memory plan: ([\d,]+) MiB")
_POOL = re.compile(r"LMCache pool ([\d,]+) MiB")
_ORDER = {"prefill": 0, "decode": 1}  # the order `bulkhead up` starts them in


@dataclass
class PlannedMemory:
    """MiB per role: the memory plan's total and the LMCache pool, as the workers told them."""

    plan_mib: dict[str, int] = field(default_factory=dict)
    pool_mib: dict[str, int] = field(default_factory=dict)

    def read(self, role: str, step: str) -> None:
        """Take what a start-up step of ``role`` tells, if anything."""
        if m := _PLAN.match(step):
            self.plan_mib[role] = int(m.group(1).replace(",", ""))
        if m := _POOL.search(step):
            self.pool_mib[role] = int(m.group(1).replace(",", ""))

    @property
    def total_mib(self) -> int:
        return sum(self.plan_mib.values()) + sum(self.pool_mib.values())

    def summary(self) -> str:
        parts = []
        for role, plan in sorted(self.plan_mib.items(), key=lambda kv: _ORDER.get(kv[0], 9)):
            pool = self.pool_mib.get(role)
            parts.append(f"{role} {plan:,} MiB" + (f" + LMCache pool {pool:,} MiB"
                                                    if pool is not None else ""))
        return (f"planned {self.total_mib:,} MiB in all ({', '.join(parts)}); each process's "
                "Python, torch and LMCache come on top")
