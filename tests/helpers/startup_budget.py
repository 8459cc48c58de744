"""How long a test waits for the processes it starts (workers, routers, `bulkhead up`) to come up.

One stated budget for the whole suite instead of a number per test: ``BULKHEAD_TEST_STARTUP_S``
seconds (default 180: a tiny-model worker pair is up in 20-40 s on 2 quiet cores), scaled by how
loaded the machine is when the wait starts (the 1-minute load average per core, from 1x up to
3x), because on a shared CI box under memory pressure a start is slow, not broken. A wait that
runs out fails with the process's log tail (``launch.launcher.wait_until``, ``wait_until_up``).
"""

from __future__ import annotations

import os

BASE_S = float(os.environ.get("BULKHEAD_TEST_STARTUP_S", "180"))
MAX_SCALE = 3.0  # 540 s at most by default: inside the suite's 600 s per-test timeout


def load_scale() -> float:
    """1 on a machine with a core free for each runnable process, up to ``MAX_SCALE``."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1.0
    return min(MAX_SCALE, max(1.0, load / (os.cpu_count() or 1)))


def startup_budget_s(share: float = 1.0) -> float:
    """Seconds to wait for a start: ``share`` of the stated budget (a router after its workers
    needs less than a worker loading weights), times the load scale."""
    return BASE_S * share * load_scale()
