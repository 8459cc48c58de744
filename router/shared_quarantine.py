"""The quarantine shared by every router on one Redis: a request that took down workers behind
one router is refused by all of them, not retried onto the workers the others still have.

`SharedQuarantine` wraps the in-memory `Quarantine` (router/quarantine.py). `add` records the
fingerprint locally and, with a Redis URL, writes ``bulkhead:quarantine:<fingerprint>`` with the
quarantine's TTL in a background task. `contains` answers from memory first, else asks Redis
(one PTTL, bounded by `timeout_s`) and keeps a hit in memory for the key's remaining TTL.
Redis slow or down means local only: fail open, one log line per outage, and for
`RETRY_AFTER_S` after a failure `contains` does not ask Redis again, so requests do not each pay
the timeout. Only the prompt's fingerprint is stored (the value is "1"), never prompt text.

This module must never block a request on Redis for longer than `timeout_s`, never raise a
Redis error into a request, and never import torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.redact import public_url, redact_text
from router.quarantine import Quarantine

log = logging.getLogger("bulkhead.router.quarantine")

KEY_PREFIX = "bulkhead:quarantine:"
REDIS_TIMEOUT_S = 0.2  # longest a request waits on Redis to learn whether it is quarantined
RETRY_AFTER_S = 5.0    # after a failed lookup, `contains` answers locally for this long


def quarantine_key(fingerprint: str) -> str:
    return KEY_PREFIX + fingerprint


class SharedQuarantine:
    """`Quarantine` plus, when `url` is set, the same entries in Redis for the other routers."""

    def __init__(self, local: Quarantine, url: str = "", *,
                 timeout_s: float = REDIS_TIMEOUT_S) -> None:
        self.local = local
        self.url = url
        self.timeout_s = timeout_s
        self._redis: Any = None
        self._is_down = False
        self._skip_until_s = 0.0   # monotonic; lookups stay local until then
        self._writes: set[asyncio.Task[None]] = set()

    def add(self, fingerprint: str) -> None:
        """Quarantine `fingerprint` here at once, and in Redis without waiting for it."""
        self.local.add(fingerprint)
        if not self.url:
            return
        task = asyncio.get_running_loop().create_task(self._write(fingerprint))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def contains(self, fingerprint: str) -> bool:
        """Whether `fingerprint` is quarantined here or, as far as Redis answers in time, by
        another router."""
        if self.local.contains(fingerprint):
            return True
        if not self.url or time.monotonic() < self._skip_until_s:
            return False
        try:
            pttl_ms = int(await asyncio.wait_for(
                self._client().pttl(quarantine_key(fingerprint)), self.timeout_s))
        except (RedisError, OSError, TimeoutError) as exc:
            self._skip_until_s = time.monotonic() + RETRY_AFTER_S
            self._failed("lookup", exc)
            return False
        self._reachable()
        if pttl_ms == -2:  # no such key
            return False
        # -1: a key without expiry (written by hand); keep it for our own TTL
        self.local.add(fingerprint, pttl_ms / 1000 if pttl_ms > 0 else None)
        return True

    async def aclose(self) -> None:
        """Let pending writes finish (each is bounded by `timeout_s`), then disconnect."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _write(self, fingerprint: str) -> None:
        ttl_ms = max(1, int(self.local.ttl_s * 1000))
        try:
            await asyncio.wait_for(
                self._client().set(quarantine_key(fingerprint), b"1", px=ttl_ms),
                self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("write", exc)
            return
        self._reachable()

    def _client(self) -> Any:
        if self._redis is None:  # connects lazily, on the running event loop
            self._redis = aioredis.from_url(self.url, socket_timeout=self.timeout_s,
                                            socket_connect_timeout=self.timeout_s)
        return self._redis

    def _failed(self, what: str, exc: BaseException) -> None:
        if not self._is_down:
            log.warning("quarantine store %s unreachable (%s failed: %s); quarantine is local "
                        "to this router until it answers again", public_url(self.url), what,
                        redact_text(str(exc)) or type(exc).__name__)
        self._is_down = True

    def _reachable(self) -> None:
        if self._is_down:
            log.info("quarantine store %s reachable again", public_url(self.url))
        self._is_down = False
