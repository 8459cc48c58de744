"""Gateway API keys: /v1 needs `Authorization: Bearer <key>` when keys are configured; /health
and /metrics stay open; a wrong key is a 401 in OpenAI's shape and never echoed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.router.conftest import MODEL, Cluster, start_cluster


@pytest.fixture(scope="module")
def keyed(loop_thread, tok) -> Iterator[Cluster]:
    cluster = start_cluster(loop_thread, tok, api_keys=("k-one", "k-two"))
    try:
        yield cluster
    finally:
        cluster.close()


def test_valid_keys_pass(keyed: Cluster) -> None:
    for key in ("k-one", "k-two"):
        r = keyed.client(api_key=key).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.choices[0].text is not None


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic k-one", "Bearer", "k-one"])
def test_missing_or_wrong_key_is_401(keyed: Cluster, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    r = httpx.post(keyed.base_url + "/v1/completions", headers=headers,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "nope" not in err["message"]
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").models.list()


def test_health_and_metrics_stay_open(keyed: Cluster) -> None:
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    assert httpx.get(keyed.base_url + "/metrics").status_code == 200


def test_keys_are_not_in_the_settings_repr() -> None:
    from router.settings import RouterSettings

    assert "k-secret" not in repr(RouterSettings(api_keys=("k-secret",)))


def test_tokenize_needs_a_key_too(keyed: Cluster) -> None:
    body = {"prompt": "hi"}
    assert httpx.post(keyed.base_url + "/tokenize", json=body).status_code == 401
    ok = httpx.post(keyed.base_url + "/tokenize", json=body,
                    headers={"Authorization": "Bearer k-one"})
    assert ok.status_code == 200 and ok.json()["count"] >= 1
