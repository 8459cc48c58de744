"""What the router presents to workers (router/worker_client.WorkerAccess): the token comes from
settings, never shows in a repr, and reaches every worker call (the real router app in front of
fake workers behind the workers' real token check); without it the router reports why no worker
is usable. A real worker with a token and TLS: tests/worker/test_auth.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from proto import bulkhead_pb2_grpc as pb_grpc
from router.app import create_app
from router.settings import RouterSettings, load_settings
from router.worker_client import WorkerAccess
from tests.router.router_fakes import SCRIPT, FakeWorker, LoopThread, TinyTokenizer
from worker.auth import InternalTokenInterceptor

TOKEN = "tok-secret-1"


def test_settings_carry_the_token_without_showing_it() -> None:
    s = load_settings(["--decode-workers", "127.0.0.1:1", "--worker-tls-ca-file", "/ca.pem"],
                      {"BULKHEAD_INTERNAL_TOKEN": "tok-secret-1"})
    assert s.internal_token == "tok-secret-1" and s.worker_tls_ca_file == "/ca.pem"
    assert "tok-secret-1" not in repr(s)


def test_access_metadata_and_ca(tmp_path: Path) -> None:
    assert WorkerAccess().metadata == ()
    access = WorkerAccess.load("tok-secret-1")
    assert access.metadata == (("authorization", "Bearer tok-secret-1"),)
    assert "tok-secret-1" not in repr(access) and access.tls_ca_pem == b""
    (tmp_path / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert WorkerAccess.load("", str(tmp_path / "ca.pem")).tls_ca_pem.startswith(b"-----")
    with pytest.raises(ValueError, match="worker_tls_ca_file: cannot read .*missing.pem"):
        WorkerAccess.load("t", str(tmp_path / "missing.pem"))


async def _guarded(worker: FakeWorker) -> grpc.aio.Server:
    """A fake worker behind the workers' real token check."""
    server = grpc.aio.server(interceptors=[InternalTokenInterceptor(TOKEN)])
    pb_grpc.add_WorkerServicer_to_server(worker, server)
    worker.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    return server


@pytest.fixture(scope="module")
def guarded(loop_thread: LoopThread, tok: TinyTokenizer) -> Iterator[dict[str, FakeWorker]]:
    script = tok.encode(SCRIPT, add_special_tokens=False)
    workers = {r: FakeWorker(r, script, tok.eos_token_ids[0]) for r in ("prefill", "decode")}
    servers = [loop_thread.run(_guarded(w)) for w in workers.values()]
    yield workers
    for s in servers:
        loop_thread.run(s.stop(grace=None))


def _router(workers: dict[str, FakeWorker], tok: TinyTokenizer, token: str) -> TestClient:
    settings = RouterSettings(model="unused", served_model_name="tiny",
                              prefill_workers=(workers["prefill"].address,),
                              decode_workers=(workers["decode"].address,),
                              split_threshold_tokens=8, internal_token=token)
    return TestClient(create_app(settings, tokenizer=tok))


def test_router_with_the_token_serves_split_requests(guarded: dict[str, FakeWorker],
                                                      tok: TinyTokenizer) -> None:
    with _router(guarded, tok, TOKEN) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x " * 40}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == SCRIPT
    assert guarded["prefill"].prefills and guarded["decode"].generates  # both calls got through


def test_router_without_the_token_says_why(guarded: dict[str, FakeWorker],
                                           tok: TinyTokenizer) -> None:
    with _router(guarded, tok, "") as client:
        r = client.get("/health")
    assert r.status_code == 503
    problems = [w.get("problem", "") for w in r.json()["workers"].values()]
    assert problems and all("UNAUTHENTICATED" in p and "missing internal token" in p
                            for p in problems), problems
