"""Requests that killed workers: remembered (by a fingerprint of their prompt) for a while and
answered 500 at once instead of being retried onto the workers that are left.

Plain data and a clock, no sockets: this is one router process's memory. With `registry_url`
the routers on that Redis share their entries through `SharedQuarantine`
(router/shared_quarantine.py), which wraps this. Never stores prompts, only their hash.
"""

from __future__ import annotations

import hashlib
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

KILLS_TO_QUARANTINE = 2  # prefill workers lost while running one request


def prompt_fingerprint(prompt_token_ids: Sequence[int]) -> str:
    # packed as little-endian int64 in C: a million-token prompt hashes in milliseconds, where
    # formatting each id as text held the event loop for a quarter of a second
    packed = array("q", prompt_token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return hashlib.blake2b(packed.tobytes(), digest_size=16).hexdigest()


class QuarantinedRequest(Exception):
    """Raised for a request whose prompt took down workers; mapped to HTTP 500 at the edge."""

    def __init__(self, fingerprint: str, num_kills: int) -> None:
        super().__init__(
            f"this request is quarantined: its prefill took down {num_kills} workers, so it is "
            f"not retried on the rest (prompt fingerprint {fingerprint[:12]})")
        self.fingerprint = fingerprint


@dataclass
class Quarantine:
    ttl_s: float = 600.0
    clock: Callable[[], float] = time.monotonic
    _until: dict[str, float] = field(default_factory=dict)

    def add(self, fingerprint: str, ttl_s: float | None = None) -> None:
        """Quarantine `fingerprint` for `ttl_s` (default: the quarantine's own TTL); a shorter
        one is what is left of an entry another router made."""
        self._until[fingerprint] = self.clock() + (self.ttl_s if ttl_s is None else ttl_s)

    def contains(self, fingerprint: str) -> bool:
        until = self._until.get(fingerprint)
        if until is None:
            return False
        if until <= self.clock():
            del self._until[fingerprint]
            return False
        return True
