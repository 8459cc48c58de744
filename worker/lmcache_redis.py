"""What Bulkhead does to LMCache's (0.5.6) Redis connector from the outside: a TTL on every
chunk it writes, its URL-printing loggers redacted, and a close that cannot deadlock.

Each hook reaches into LMCache objects by attribute and degrades to a no-op (returning False or
logging) when another LMCache version keeps them elsewhere. Never imported by the router; never
touches engine state.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from common.redact import redact_logger, redact_text

log = logging.getLogger(__name__)

# LMCache modules that log the remote URL (config dump, connector creation, health checks):
# imported before the engine is built so their loggers exist when the redaction is installed.
LMCACHE_URL_LOGGERS = (
    "lmcache.v1.config",
    "lmcache.v1.cache_engine",
    "lmcache.v1.storage_backend.remote_backend",
    "lmcache.v1.storage_backend.connector",
    "lmcache.v1.storage_backend.connector.redis_adapter",
    "lmcache.v1.storage_backend.connector.redis_connector",
    "lmcache.v1.health_monitor.checks.remote_backend_check",
)

REDIS_KEY_SUFFIXES = ("kv_bytes", "metadata")  # LMCache's Redis keys: chunk key + suffix


def redact_lmcache_logs() -> None:
    """LMCache prints its remote URL, password included, at INFO; its loggers do not propagate
    and each has its own handler, so each gets a redacting filter."""
    for name in LMCACHE_URL_LOGGERS:
        try:
            importlib.import_module(name)
        except ImportError:  # another LMCache version: the loop below still covers the rest
            log.debug("LMCache module %s not found", name)
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("lmcache") and isinstance(logger, logging.Logger):
            redact_logger(logger)


class ExpiringRedis:
    """LMCache's asyncio Redis client with a TTL on every SET (all else passes through), so a
    chunk key is never, even for a moment, stored without expiry."""

    def __init__(self, inner: Any, ttl_s: int) -> None:  # noqa: ANN401 - redis.asyncio.Redis
        self._inner = inner
        self.ttl_s = ttl_s

    async def set(self, name: Any, value: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        if not args and not any(kwargs.get(k) for k in ("ex", "px", "exat", "pxat", "keepttl")):
            kwargs["ex"] = self.ttl_s
        return await self._inner.set(name, value, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self._inner, name)


def expire_on_write(engine: object, ttl_s: int) -> bool:
    """Route the Redis connector's writes through ``ExpiringRedis``; False if there is no
    Redis connector where LMCache 0.5.6 keeps it."""
    connector = remote_connector(engine)
    connection = getattr(connector, "connection", None)
    if connection is None or not hasattr(connection, "set"):
        return False
    if not isinstance(connection, ExpiringRedis):
        connector.connection = ExpiringRedis(connection, ttl_s)
    return True


def remote_connector(engine: object) -> Any:  # noqa: ANN401 - an LMCache RemoteConnector
    """The connector behind LMCache's remote backend (unwrapped), or None."""
    manager = getattr(engine, "storage_manager", None)
    backend = getattr(manager, "storage_backends", {}).get("RemoteBackend")
    connector = getattr(backend, "connection", None)
    unwrap = getattr(connector, "getWrappedConnector", None)
    return unwrap() if unwrap is not None else connector


def avoid_redis_close_deadlock(engine: object) -> None:
    """LMCache 0.5.6's RedisConnector.close() runs on its event loop and calls the blocking
    ``pq_executor.shutdown()``, which schedules onto that same loop and waits: a deadlock that
    keeps the process from exiting. Point the instance at the coroutine version it can await."""
    connector = remote_connector(engine)
    executor = getattr(connector, "pq_executor", None)
    if executor is not None and hasattr(executor, "shutdown_async"):
        executor.shutdown = executor.shutdown_async


def refresh_ttl(client: Any, chunk_keys: list[str], ttl_s: int,  # noqa: ANN401 - redis.Redis
                public_url: str) -> None:
    """Reset the TTL of stored chunks (both Redis keys of each) through ``client`` (None: not a
    Redis store). Best effort: a store that is down only means they expire on their first
    schedule."""
    if client is None or not ttl_s or not chunk_keys:
        return
    try:
        with client.pipeline(transaction=False) as pipe:
            for key in chunk_keys:
                for suffix in REDIS_KEY_SUFFIXES:
                    pipe.expire(key + suffix, ttl_s)
            pipe.execute()
    except Exception as exc:  # redis-py raises several types; never fail a store on it
        log.warning("KV store %s: could not refresh the TTL of %d chunks: %s",
                    public_url, len(chunk_keys), redact_text(str(exc)))
