"""A real redis-server for tests, on a free loopback port, always stopped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.launcher import redis_server_path, start_redis


@contextmanager
def running_redis(log_dir: Path, maxmemory_mb: int = 256) -> Iterator[str]:
    """Yields the URL of a fresh redis-server; skips the test if redis-server is missing."""
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    proc, url = start_redis(log_dir=log_dir, maxmemory_mb=maxmemory_mb)
    try:
        yield url
    finally:
        proc.stop(grace_s=5.0)
