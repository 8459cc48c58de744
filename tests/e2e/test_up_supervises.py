"""`bulkhead up` survives the death of any one of its children (real processes, a real
redis-server, loopback): SIGKILL the prefill worker, then the decode worker, then Redis, each
while 8 streaming chats run, and last the router. Every stream ends with an answer or an OpenAI error event, then
`data: [DONE]`; the supervisor restarts the dead child by itself; and a new request is served
within 30 s each time. Ctrl-C then stops everything cleanly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from launch.launcher import free_port, redis_server_path
from tests.e2e.conftest import MAX_CONTEXT
from tests.helpers.startup_budget import startup_budget_s
from tests.helpers.tiny_model import write_tiny_llama
from tests.helpers.up_process import stop_up, up_process, wait_until_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORKER = {"device": "cpu", "max_context": MAX_CONTEXT, "chunk_tokens": 48, "max_batch": 8,
          "block_size": 16, "attn_tile_tokens": 64, "lmcache_chunk_size": 16,
          "kv_staging_gb": 0.05, "num_threads": 1}
ROUTER = {"split_threshold_tokens": 40, "poll_interval_s": 0.5}


class Stream(threading.Thread):
    """One streamed chat; records its SSE data lines."""

    def __init__(self, url: str, model: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompt = url, model, prompt
        self.lines: list[str] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              timeout=120) as resp:
                if resp.status_code != 200:
                    self.lines.append(f"status {resp.status_code} {resp.read()!r}")
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()

    def outcome(self) -> str:
        """'answer', 'error event' or a description of what went wrong."""
        if self.error is not None:
            return f"transport error {self.error!r}"
        if not self.lines or self.lines[-1] != "[DONE]":
            return f"no [DONE]: {self.lines[-3:]}"
        events = [json.loads(x) for x in self.lines[:-1] if x.startswith("{")]
        if any("error" in e for e in events):
            err = next(e for e in events if "error" in e)["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            return "error event"
        finishes = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
        return "answer" if "length" in finishes or "stop" in finishes else f"unfinished {events[-1:]}"


def _child(up: psutil.Process, needle: str) -> psutil.Process:
    for p in up.children(recursive=False):
        with __import__("contextlib").suppress(psutil.Error):
            if needle in " ".join(p.cmdline()):
                return p
    raise AssertionError(f"no child {needle!r} of bulkhead up")


def _served(url: str, model: str, timeout_s: float) -> float:
    """Seconds until a new (non-streamed) chat is answered 200."""
    started = time.monotonic()
    while True:
        try:
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": model, "messages": [{"role": "user", "content": "hello again " * 8}],
                "max_tokens": 4})
            if r.status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        assert time.monotonic() - started < timeout_s, "no new request served in time"
        time.sleep(0.5)


def test_up_restarts_each_child_and_every_stream_ends_with_a_word(tmp_path: Path) -> None:
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    folder = write_tiny_llama(tmp_path / "tiny")
    config = tmp_path / "up.yaml"
    config.write_text(yaml.safe_dump({"worker": WORKER, "router": ROUTER}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out_path = tmp_path / "up.out"
    args = ["--model", str(folder), "--port", str(port), "--config", str(config),
            "--log-dir", str(tmp_path / "logs")]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with up_process(args, out_path, env) as proc:
        wait_until_up(proc, out_path, budget_s=startup_budget_s(5 / 3),
                      log_dir=tmp_path / "logs")
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        up = psutil.Process(proc.pid)
        report = []
        for victim in ("launch.cli prefill", "launch.cli decode", "redis-server"):
            target = _child(up, victim)
            # long prompts go through the prefill worker, short ones straight to decode
            streams = [Stream(url, model, ("tell me a long story " * (12 if i % 2 else 1)))
                       for i in range(8)]
            for s in streams:
                s.start()
            for s in streams:
                assert s.started.wait(60)
            target.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            for s in streams:
                s.join(120)
                assert not s.is_alive()
            outcomes = [s.outcome() for s in streams]
            assert all(o in ("answer", "error event") for o in outcomes), (victim, outcomes)
            back_s = _served(url, model, 30.0 - (time.monotonic() - killed))
            report.append((victim, outcomes.count("answer"), outcomes.count("error event"),
                           round(time.monotonic() - killed, 1), round(back_s, 1)))
            assert proc.poll() is None, out_path.read_text()
            # the supervisor restarted it: a new process with the same command line
            deadline = time.monotonic() + 60
            while True:
                with __import__("contextlib").suppress(AssertionError):
                    if _child(up, victim).pid != target.pid:
                        break
                assert time.monotonic() < deadline, out_path.read_text()
                time.sleep(0.5)
        # the router too: its clients see EOF (nothing can send them a word), but it comes back
        router = _child(up, "launch.cli router")
        router.send_signal(signal.SIGKILL)
        report.append(("router", 0, 0, 0.0, round(_served(url, model, 30.0), 1)))
        assert _child(up, "launch.cli router").pid != router.pid
        print("victim, answers, error events, s from kill to a new answer:", report)
        text = out_path.read_text()
        for victim in ("prefill", "decode", "redis", "router"):
            assert f"{victim} (pid" in text and f"{victim} restarted" in text, text
        stop_up(proc, out_path)
