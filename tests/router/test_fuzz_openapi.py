"""Schema-driven fuzzing of the HTTP API (schemathesis over the router's own OpenAPI schema):
whatever a client sends, the answer is never a 5xx and the router stays healthy."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.router.conftest import Cluster, start_cluster  # noqa: E402

schema = schemathesis.pytest.from_fixture("router_schema")


@pytest.fixture(scope="module")
def fuzz_cluster(loop_thread, tok) -> Iterator[Cluster]:
    cluster = start_cluster(loop_thread, tok)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def router_schema(fuzz_cluster: Cluster):
    return schemathesis.openapi.from_url(fuzz_cluster.base_url + "/openapi.json")


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_cluster: Cluster) -> None:
    response = case.call(timeout=20)
    assert response.status_code < 500, (case.method, case.path, response.status_code,
                                        response.text[:500])
    assert httpx.get(fuzz_cluster.base_url + "/health", timeout=5).status_code == 200
