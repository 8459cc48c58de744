"""The router's own bound on requests in flight: past it, new requests get 429 at once.

Workers bound their queues too (RESOURCE_EXHAUSTED -> 429); this bound keeps the router itself
from piling up unbounded work (tokenization, open streams) when clients outpace the workers.
Single event loop, so a plain counter is enough; it must never block or wait for a slot.
"""

from __future__ import annotations

from router.errors import queue_full


class Admission:
    def __init__(self, max_inflight: int, retry_after_s: int) -> None:
        self.max_inflight = max_inflight      # 0 = unbounded
        self._retry_after_s = retry_after_s
        self.num_inflight = 0

    def acquire(self) -> None:
        """Take one slot; raise ApiError 429 if none is free.  Pair with `release()`."""
        if self.max_inflight and self.num_inflight >= self.max_inflight:
            raise queue_full(self._retry_after_s,
                             f"the router holds max_inflight_requests={self.max_inflight}")
        self.num_inflight += 1

    def release(self) -> None:
        assert self.num_inflight > 0
        self.num_inflight -= 1
