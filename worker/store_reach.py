"""Reaching the KV store's server: a checked synchronous Redis client and a TCP reachability
probe, both failing with a KVStoreError that names the store (password masked). Used by
worker/kv_store.py at start-up and by its health check; never touches LMCache or tensors.
"""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlsplit

from common.redact import redact_text, redact_url
from worker.kv_store_config import REDIS_SCHEMES, KVStoreError


def redis_client(url: str) -> Any:  # noqa: ANN401 - redis.Redis, imported lazily
    """A small synchronous client of a Redis store (TTL refreshes), after a PING that checks the
    password and TLS now rather than at the first handoff; None for other schemes."""
    if urlsplit(url).scheme not in REDIS_SCHEMES:
        return None
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=5.0)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as e:
        raise KVStoreError(f"KV store {redact_url(url)} refused the connection: "
                           f"{type(e).__name__}: {redact_text(str(e))}") from None
    return client


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Fail at start-up, naming the store, rather than serve with a store LMCache cannot reach
    (it would only log, and every handoff would silently fall back to recompute)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            pass
    except OSError as e:
        raise KVStoreError(f"cannot reach the KV store at {redact_url(url)}: {e}") from e
