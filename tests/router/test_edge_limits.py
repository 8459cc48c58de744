"""A bounded edge: an oversized body is refused before it is read, and neither it nor a long
prompt just under the limit stalls the streams and health checks the router is serving.

Router in its own process (real SmolLM2 tokenizer), fake workers, loopback only."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.default_model import default_model_or_skip
from tests.router.edge_cluster import MODEL, EdgeRouter, edge_router, send_raw
from tests.router.router_fakes import LoopThread

pytestmark = pytest.mark.timeout(300)

LIMIT = 4 * 1024 * 1024 + 64 * 1024   # a 4 MB prompt fits just under it
MB = 1024 * 1024


@pytest.fixture(scope="module")
def router(loop_thread: LoopThread, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[EdgeRouter]:
    default_model_or_skip()
    # a context that holds a 4 MB prompt, so it is tokenized and served, not refused by length
    with edge_router(loop_thread, tmp_path_factory.mktemp("edge"), max_context=4_000_000,
                     max_body_bytes=LIMIT) as r:
        yield r


class StreamWatch(threading.Thread):
    """One streamed chat read chunk by chunk; records the largest gap between two chunks."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.first = threading.Event()
        self.max_gap_s = 0.0
        self.lines: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=body,
                              timeout=60) as resp:
                last = None
                for line in resp.iter_lines():
                    if not line:
                        continue
                    now = time.monotonic()
                    if last is not None:
                        self.max_gap_s = max(self.max_gap_s, now - last)
                    last = now
                    self.lines.append(line)
                    self.first.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.first.set()


class HealthWatch(threading.Thread):
    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.stop = threading.Event()
        self.max_latency_s = 0.0
        self.num = 0

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as h:
            while not self.stop.is_set():
                started = time.monotonic()
                assert h.get("/health").status_code == 200
                self.max_latency_s = max(self.max_latency_s, time.monotonic() - started)
                self.num += 1
                time.sleep(0.05)


def _head(port: int, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\n{framing}\r\n\r\n").encode()


def _big_chat_body(num_bytes: int) -> bytes:
    prefix = b'{"model":"tiny","messages":[{"role":"user","content":"'
    suffix = b'"}],"max_tokens":4}'
    return prefix + b"a" * (num_bytes - len(prefix) - len(suffix)) + suffix


def _pieces(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def _chunked(data: bytes, size: int = 256 * 1024) -> Iterator[bytes]:
    for piece in _pieces(data, size):
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


def _with_load(router: EdgeRouter, attack: callable) -> tuple[list[StreamWatch], HealthWatch]:
    streams = [StreamWatch(router.base_url, max_tokens=500) for _ in range(4)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(30) and s.error is None, s.error
    health = HealthWatch(router.base_url)
    health.start()
    try:
        deadline = time.monotonic() + 10
        while health.num < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        attack()
        time.sleep(0.5)   # health checks that were queued behind the attack count too
    finally:
        health.stop.set()
        health.join(30)
    for s in streams:
        s.join(60)
        assert not s.is_alive()
        assert s.error is None, s.error
        assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
    return streams, health


def test_five_50mb_bodies_get_413_fast_without_stalling_anyone(router: EdgeRouter) -> None:
    big = _big_chat_body(50 * MB)
    rss_before = router.rss_bytes()
    results: list[tuple[int, bytes, float]] = []

    def attack() -> None:
        for framed in ("length", "length", "chunked", "length", "length"):
            if framed == "length":
                results.append(send_raw(router.port, _head(router.port, len(big)), _pieces(big)))
            else:
                results.append(send_raw(router.port, _head(router.port, None), _chunked(big)))

    streams, health = _with_load(router, attack)
    rss_after = router.rss_bytes()
    for status, answer, elapsed in results:
        assert status == 413, answer[:300]
        err = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "request_too_large" and str(LIMIT) in err["message"], err
        assert elapsed < 1.0, elapsed
    gaps = [s.max_gap_s for s in streams]
    print(f"413 in {[round(r[2], 3) for r in results]} s; stream max gaps {gaps}; /health max "
          f"{health.max_latency_s:.3f} s over {health.num}; RSS {rss_before / MB:.0f} -> "
          f"{rss_after / MB:.0f} MB")
    assert max(gaps) < 1.0, gaps
    assert health.num > 0 and health.max_latency_s < 1.0, health.max_latency_s
    assert rss_after - rss_before < 50 * MB, (rss_before, rss_after)


def test_a_chunked_body_over_the_limit_is_cut_off(router: EdgeRouter) -> None:
    """No Content-Length: the bytes are counted as they arrive, and the answer comes as soon
    as the limit is passed, before the client has sent the rest."""
    big = _big_chat_body(LIMIT + MB)
    status, answer, _ = send_raw(router.port, _head(router.port, None), _chunked(big, 64 * 1024))
    assert status == 413, answer[:300]
    with router.http() as h:
        assert h.get("/health").status_code == 200


def test_a_body_just_under_the_limit_is_read(router: EdgeRouter) -> None:
    """The limit is on the body, not on anything smaller: a 4 MB body of the wrong type is
    parsed and refused for its type (400), not for its size."""
    body = json.dumps({"model": MODEL, "messages": "x" * (4 * MB)}).encode()
    assert len(body) < LIMIT
    status, answer, _ = send_raw(router.port, _head(router.port, len(body)), _pieces(body))
    assert status == 400 and b'"messages"' in answer, answer[:300]


def test_a_4mb_prompt_under_the_limit_does_not_stall_streams(router: EdgeRouter) -> None:
    text = ("The quick brown fox jumps over the lazy dog; " * 100_000)[:4 * MB - 4096]
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    payload = json.dumps(body).encode()
    assert len(payload) < LIMIT
    answers: list[httpx.Response] = []
    timing: list[float] = []

    def attack() -> None:
        started = time.monotonic()
        answers.append(httpx.post(router.base_url + "/v1/chat/completions", content=payload,
                                  headers={"content-type": "application/json"}, timeout=120))
        timing.append(time.monotonic() - started)

    streams, health = _with_load(router, attack)
    gaps = [s.max_gap_s for s in streams]
    r = answers[0]
    print(f"4 MB prompt: {r.status_code} in {timing[0]:.2f} s; stream max gaps {gaps}; "
          f"/health max {health.max_latency_s:.3f} s")
    assert r.status_code == 200, r.text[:500]
    assert r.json()["usage"]["prompt_tokens"] > 500_000
    assert max(gaps) < 1.0, gaps
    assert health.max_latency_s < 1.0


def test_a_prompt_certainly_over_the_context_is_refused_before_tokenizing(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    """A 4 MB prompt against a 512-token context: refused from its length alone, at once."""
    default_model_or_skip()
    with edge_router(loop_thread, tmp_path, max_context=512, max_body_bytes=LIMIT) as router:
        text = "word " * (800 * 1024)
        started = time.monotonic()
        with router.http() as h:
            r = h.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": text}]})
        elapsed = time.monotonic() - started
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
        assert err["param"] == "messages"
        # tokenizing 4 MB takes seconds here; the length check takes milliseconds
        assert elapsed < 1.0, elapsed


@pytest.mark.parametrize("size", [200_000, 1_000_000])
def test_a_huge_header_gets_431_not_a_reset(router: EdgeRouter, size: int) -> None:
    """The head past max_header_bytes is answered 431 and the connection drains what the client
    still sends, so an ordinary client reads the answer instead of a connection reset."""
    with httpx.Client(base_url=router.base_url, timeout=10) as h:
        r = h.post("/v1/chat/completions", headers={"x-big": "a" * size},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 431, r.text
    with router.http() as h:
        assert h.get("/health").status_code == 200
