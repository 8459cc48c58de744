"""Fixtures for the worker-side service tests: a real redis-server on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.redis_server import running_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
