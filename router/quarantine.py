"""Requests that killed workers: remembered (by a fingerprint of the request) for a while and
answered 500 at once instead of being tried on the workers that are left.

Who is to blame for a crash is router/crash_blame.py's call; this is the memory of the verdicts.
Plain data and a clock, no sockets: this is one router process's memory. With `registry_url`
the routers on that Redis share their entries through `SharedQuarantine`
(router/shared_quarantine.py), which wraps this. Never stores prompts, only their hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from router.worker_codec import Sampling


def request_fingerprint(model: str, prompt_token_ids: Sequence[int],
                        sampling: Sampling | None = None) -> str:
    """The hash of what a worker is given: the model, the prompt's token ids and the sampling
    and grammar parameters (``seed`` excepted: the n choices of a request draw from seed + i,
    and are one request). The same prompt with other parameters is another request: a crash
    that a temperature or a grammar causes must not quarantine every user of the prompt."""
    # packed as little-endian int64 in C: a million-token prompt hashes in milliseconds, where
    # formatting each id as text held the event loop for a quarter of a second
    packed = array("q", prompt_token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.blake2b(digest_size=16)
    h.update(model.encode("utf-8", "surrogatepass") + b"\0")
    h.update(repr(dataclasses.replace(sampling, seed=None)).encode("utf-8", "surrogatepass")
             if sampling is not None else b"")
    h.update(b"\0" + packed.tobytes())
    return h.hexdigest()


class QuarantinedRequest(Exception):
    """Raised for a request that took down a worker; mapped to HTTP 500 at the edge."""

    def __init__(self, fingerprint: str, why: str, ttl_s: float) -> None:
        super().__init__(
            f"this request is quarantined: {why}. An identical request (same model, prompt "
            f"tokens and sampling parameters) is refused for {ttl_s:g} s after that crash "
            f"(quarantine_ttl_s) instead of being tried on the workers that are left "
            f"(request fingerprint {fingerprint[:12]})")
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
