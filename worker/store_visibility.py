"""How long a prefill worker waits for the KV it stored to become visible to a peer.

LMCache writes to the remote store in a background loop and only logs a dropped write, so the
prefill side polls what the store holds before telling the router "KV ready". This module
decides when to stop polling (all visible, the deadline, no progress for ``stall_s``, the store
unreachable); it never reads or writes the store itself: the caller passes the probes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def wait_visible(visible_tokens: Callable[[], int], num_tokens: int,
                 reachable: Callable[[], bool], timeout_s: float, stall_s: float | None,
                 store_name: str) -> int:
    """Poll ``visible_tokens()`` until it reaches ``num_tokens``, ``timeout_s`` passes or
    (``stall_s``) nothing new showed for that long; stop at once when ``reachable()`` says the
    store is down. Returns the last count seen."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    seen, since = -1, time.monotonic()
    while True:
        visible = visible_tokens()
        if visible != seen:
            seen, since = visible, time.monotonic()
        elif stall_s is not None and time.monotonic() - since >= stall_s:
            log.warning("KV store: %d of %d tokens visible, none more for %.1f s",
                        visible, num_tokens, stall_s)
            return visible
        if visible < num_tokens and not reachable():
            # The store is down: nothing will become visible, so do not hold the request
            # for the whole timeout; the decode side recomputes what is missing.
            log.warning("KV store %s unreachable: %d of %d tokens visible, not waiting",
                        store_name, visible, num_tokens)
            return visible
        if visible >= num_tokens or time.monotonic() >= deadline:
            if visible < num_tokens:
                log.warning("KV store: only %d of %d tokens visible after %.1f s",
                            visible, num_tokens, timeout_s)
            return visible
        time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
        delay = min(delay * 2, 0.02)
