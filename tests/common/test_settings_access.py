"""Worker access settings (common/settings.py): the internal token, TLS files, KV TTL and a
Redis URL with a password or TLS; secrets never show in a repr."""

from __future__ import annotations

import pytest

from common.settings import SettingsError, WorkerSettings, load_worker_settings


def test_access_settings_from_env_and_no_secret_in_repr() -> None:
    s = load_worker_settings("prefill", [], {
        "BULKHEAD_KV_STORE_URL": "rediss://:pw-Secret9@cache:6380/0?ssl_ca_certs=/ca.pem",
        "BULKHEAD_INTERNAL_TOKEN": "tok-Secret8", "BULKHEAD_KV_TTL_S": "600",
        "BULKHEAD_TLS_CERT_FILE": "/c.pem", "BULKHEAD_TLS_KEY_FILE": "/k.pem"})
    assert s.kv_ttl_s == 600 and s.internal_token == "tok-Secret8"
    assert (s.tls_cert_file, s.tls_key_file) == ("/c.pem", "/k.pem")
    assert "Secret9" not in repr(s) and "Secret8" not in repr(s)
    assert WorkerSettings().kv_ttl_s == 3600 and WorkerSettings().internal_token == ""


@pytest.mark.parametrize("kwargs, needle", [
    ({"kv_ttl_s": -1}, "kv_ttl_s"),
    ({"tls_key_file": "/k.pem"}, "give both"),
    ({"kv_store_url": "http://cache:1"}, "rediss://"),
])
def test_bad_access_settings_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        WorkerSettings(**kwargs)
