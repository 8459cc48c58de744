"""A real redis-server for tests, on a free loopback port, always stopped afterwards; optionally
with a password (``--requirepass``) and TLS only (``rediss://``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from launch.launcher import free_port, redis_server_path, spawn, start_redis, tcp_open, wait_until
from tests.helpers.tls import TlsFiles


@contextmanager
def running_redis(log_dir: Path, maxmemory_mb: int = 256, *, password: str = "",
                  tls: TlsFiles | None = None) -> Iterator[str]:
    """Yields the URL of a fresh redis-server (``redis://:password@...`` with a password,
    ``rediss://...?ssl_ca_certs=CA`` with TLS); skips the test if redis-server is missing."""
    exe = redis_server_path()
    if exe is None:
        pytest.skip("redis-server is not installed")
    if not password and tls is None:
        proc, url = start_redis(log_dir=log_dir, maxmemory_mb=maxmemory_mb)
    else:
        port = free_port()
        argv = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "allkeys-lru"]
        if password:
            argv += ["--requirepass", password]
        if tls is None:
            argv += ["--port", str(port)]
        else:
            argv += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert_file),
                     "--tls-key-file", str(tls.key_file), "--tls-ca-cert-file", str(tls.ca_file),
                     "--tls-auth-clients", "no"]
        proc = spawn("redis", argv, log_dir=log_dir)
        wait_until(proc, lambda: tcp_open("127.0.0.1", port), 15.0, f"listening on {port}")
        auth = f":{password}@" if password else ""
        url = (f"redis://{auth}127.0.0.1:{port}" if tls is None else
               f"rediss://{auth}127.0.0.1:{port}?ssl_ca_certs={tls.ca_file}")
    try:
        yield url
    finally:
        proc.stop(grace_s=5.0)
