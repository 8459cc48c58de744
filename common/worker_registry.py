"""The Redis key scheme of the worker registry, shared by the worker that publishes its
WorkerInfo (worker/registration.py) and the router that discovers it (router/redis_registry.py).

A worker keeps one key, ``bulkhead:worker:<role>:<worker_id>``, whose value is its serialized
``bulkhead.v1.WorkerInfo`` and whose TTL is its heartbeat. This module must never talk to the
network or import torch: both sides import it, and the router stays light.
"""

from __future__ import annotations

from urllib.parse import urlsplit

KEY_PREFIX = "bulkhead:worker:"
SCAN_PATTERN = KEY_PREFIX + "*"
SCHEMES = ("redis", "rediss")


def worker_key(role: str, worker_id: str) -> str:
    """The registry key of worker ``worker_id`` serving ``role``."""
    return f"{KEY_PREFIX}{role}:{worker_id}"


def role_of_key(key: str) -> str:
    """The role a key was published under ('' when the key is not a worker key)."""
    if not key.startswith(KEY_PREFIX):
        return ""
    role, sep, _ = key.removeprefix(KEY_PREFIX).partition(":")
    return role if sep else ""


def url_problem(url: str) -> str:
    """Why ``url`` cannot be a registry URL ('' when it can)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        return f"{parts.scheme or url!r} scheme; use redis://[:password@]host:port[/db] or rediss://"
    if not parts.hostname:
        return "no host; use redis://[:password@]host:port[/db]"
    return ""


