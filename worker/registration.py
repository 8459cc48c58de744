"""Worker-side half of the Redis worker registry: keep this worker's WorkerInfo under its key
(common/worker_registry.py) with a TTL, refreshed every ``ttl_s / 3``, so routers discover the
worker, read its load and progress counters, and drop it once it stops refreshing.

The publisher runs on the worker's asyncio loop and gets the info from ``info_fn``, which reads
the engine loop's last stats snapshot: it never calls the engine and never blocks the engine
thread. Redis being down never stops the worker: the failure is logged once, the worker keeps
serving, and every beat retries. A graceful stop deletes the key, so routers drop the worker at
their next scan instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.periodic import Periodic
from common.redact import public_url
from common.settings import WorkerSettings
from common.worker_registry import url_problem, worker_key
from proto import bulkhead_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class RegistrationPublisher:
    """Publishes ``info_fn()`` under ``key`` in ``url`` until ``stop()``."""

    url: str
    key: str
    info_fn: Callable[[], pb.WorkerInfo]
    ttl_s: float = 10.0
    _client: Any = field(default=None, init=False, repr=False)
    _beats: Periodic | None = field(default=None, init=False, repr=False)
    _failing: bool = field(default=False, init=False)
    num_published: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        problem = url_problem(self.url)
        if problem:
            raise ValueError(f"registry_url: {problem}")
        if self.ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s: {self.ttl_s} must be > 0")

    @property
    def interval_s(self) -> float:
        # three beats per TTL: one lost or late beat never lets the key expire
        return self.ttl_s / 3

    async def start(self) -> None:
        """Publish once (a failure only logs) and keep publishing from a background task."""
        self._client = aioredis.from_url(self.url, socket_timeout=self.interval_s,
                                         socket_connect_timeout=self.interval_s)
        await self.publish()
        self._beats = Periodic(self.publish, self.interval_s, "registry heartbeat")
        self._beats.start()

    async def publish(self) -> bool:
        """One heartbeat: SET key info PX ttl. False (logged once) when Redis did not take it."""
        try:
            payload = self.info_fn().SerializeToString()
            async with asyncio.timeout(self.interval_s):  # a hung Redis must not stall beats
                await self._client.set(self.key, payload, px=max(int(self.ttl_s * 1000), 1))
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._failing:
                log.warning("worker registry %s unreachable; still serving, retrying every "
                            "%.1f s: %s", public_url(self.url), self.interval_s, exc)
            self._failing = True
            return False
        if self._failing or self.num_published == 0:
            log.info("registered as %s in %s (TTL %g s)", self.key, public_url(self.url),
                     self.ttl_s)
        self._failing = False
        self.num_published += 1
        return True

    async def stop(self) -> None:
        """Stop beating (bounded: common/periodic.py) and delete the key (best effort, bounded
        by one interval)."""
        if self._beats is not None:
            await self._beats.stop()
            self._beats = None
        if self._client is None:
            return
        try:
            async with asyncio.timeout(self.interval_s):
                await self._client.delete(self.key)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("could not delete registry key %s (it expires in %g s): %s", self.key,
                        self.ttl_s, exc)
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
        self._client = None


def registration_publisher(settings: WorkerSettings, role: str,
                           info_fn: Callable[[], pb.WorkerInfo]) -> RegistrationPublisher | None:
    """The publisher ``settings`` ask for (None without ``registry_url``)."""
    if not settings.registry_url:
        return None
    host = settings.address.rpartition(":")[0].strip("[]")
    if host in ("0.0.0.0", "::", ""):
        log.warning("registering address %s, which peers cannot dial; set advertise_address",
                    settings.address)
    return RegistrationPublisher(settings.registry_url, worker_key(role, settings.name), info_fn,
                                 settings.heartbeat_ttl_s)
