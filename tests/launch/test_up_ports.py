"""`bulkhead up` refuses a taken or twice-given port before it starts anything: before this, a
second `up` on a busy port started its workers and KV store, wiped the first one's logs, and
restarted its router (which could not bind) in a loop while reporting it serving, because the
health checks reached the other server."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from common.ports import port_in_use
from common.router_identity import INSTANCE_ENV, INSTANCE_HEADER
from launch import health, up
from launch.launcher import free_port

pytestmark = pytest.mark.timeout(60)


def test_a_port_another_server_listens_on_is_refused_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    started: list[object] = []
    monkeypatch.setattr(up, "spawn", lambda *a, **k: started.append(a))
    monkeypatch.setattr(up, "start_kv_server", lambda **k: started.append(k))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        logs = up.default_log_dir(port)
        logs.mkdir(parents=True)
        (logs / "router.log").write_text("the running server's log\n")
        t = time.monotonic()
        assert up.main(["--model", "unused", "--port", str(port)]) == 1
        assert time.monotonic() - t < 5
    err = capsys.readouterr().err
    assert f"--port {port} on 127.0.0.1 is already in use" in err, err
    assert started == []  # no KV store, no worker
    assert (logs / "router.log").read_text() == "the running server's log\n"


def test_a_worker_port_given_twice_or_taken_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(up, "start_kv_server", lambda **k: pytest.fail("started a KV store"))
    port = free_port()
    assert up.main(["--model", "unused", "--port", str(port), "--prefill-port", str(port)]) == 1
    assert f"--prefill-port {port} is also --port" in capsys.readouterr().err
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        assert up.main(["--model", "unused", "--port", str(port), "--decode-port", str(taken)]) == 1
    assert f"--decode-port {taken} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_port_in_use_follows_the_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)  # closed: free again (SO_REUSEADDR)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_on_a_taken_port_exits_before_loading_the_model(role: str) -> None:
    import subprocess
    import sys

    from tests.helpers.default_model import default_model_or_skip

    model = default_model_or_skip()
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        # the prefill worker needs a store URL to start at all; nothing listens there, and the
        # port check comes before anything would reach it
        store = ["--kv-store-url", f"redis://127.0.0.1:{free_port()}"] if role == "prefill" else []
        proc = subprocess.run([sys.executable, "-m", "launch.cli", role, "--model", str(model),
                               "--host", "127.0.0.1", "--port", str(port), *store],
                              capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"127.0.0.1:{port}: the port is already in use" in proc.stderr, proc.stderr[-2000:]
    assert "loading weights" not in proc.stderr + proc.stdout


def test_up_knows_its_router_from_another_server_on_the_port() -> None:
    """/health answers carry the id `up` started its router with; an answer without it (another
    server that took the port while our router restarted) is not our router serving again."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sent: dict[str, str] = {}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"status": "ok", "workers": {"w": {"healthy": True}}}).encode()
            self.send_response(200)
            for key, value in sent.items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert health.router_ready(url, 1) and health.http_answers(url)  # no id asked: any answer
        assert not health.router_ready(url, 1, "ours") and not health.http_answers(url, "ours")
        sent[INSTANCE_HEADER] = "theirs"
        assert not health.router_ready(url, 1, "ours") and not health.http_answers(url, "ours")
        sent[INSTANCE_HEADER] = "ours"
        assert health.router_ready(url, 1, "ours") and health.http_answers(url, "ours")
    finally:
        server.shutdown()


def test_the_router_answers_health_with_the_id_it_was_started_with(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from router.app import create_app
    from router.settings import RouterSettings
    from tests.router.router_fakes import TinyTokenizer

    # a worker address nobody serves: /health answers 503 (no decode worker), with the id
    settings = RouterSettings(model="unused", served_model_name="tiny",
                              decode_workers=(f"127.0.0.1:{free_port()}",))
    monkeypatch.setenv(INSTANCE_ENV, "abc123")
    with TestClient(create_app(settings, tokenizer=TinyTokenizer())) as client:
        r = client.get("/health")
    assert r.status_code == 503 and r.headers[INSTANCE_HEADER] == "abc123"
    monkeypatch.delenv(INSTANCE_ENV)
    with TestClient(create_app(settings, tokenizer=TinyTokenizer())) as client:
        assert INSTANCE_HEADER not in client.get("/health").headers
