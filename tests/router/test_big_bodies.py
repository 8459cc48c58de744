"""The router's loop stays free while it handles the largest bodies under the limit: /health
answers fast while one request carries millions of token ids or hundreds of thousands of chat
messages (issue 39: 7.0 s, 5.5 s and 3.4 s of a frozen loop before), and the answers are the
ones the small-body path gives. Each case runs against the router as served and, for the
figures beside it (printed with -s), with every body parsed on the loop.

Router in its own process (real SmolLM2 tokenizer), fake workers, loopback only."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.default_model import default_model_or_skip
from tests.router.edge_cluster import MODEL, EdgeRouter, edge_router
from tests.router.router_fakes import LoopThread

pytestmark = pytest.mark.timeout(300)
LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module", params=["off-loop", "on-loop"])
def router(request: pytest.FixtureRequest, loop_thread: LoopThread,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeRouter]:
    """The router as served, and (for the figures beside it) with every body parsed on the
    loop as before."""
    default_model_or_skip()
    extra = ("--parse-off-loop-bytes", "0") if request.param == "on-loop" else ()
    with edge_router(loop_thread, tmp_path_factory.mktemp("big"), max_context=4096,
                     max_body_bytes=LIMIT, extra_args=extra) as r:
        r.mode = request.param
        yield r


def health_during(router: EdgeRouter, path: str, body: dict) -> tuple[httpx.Response, float,
                                                                       float]:
    """-> (the answer to ``body``, its seconds, the slowest /health meanwhile)."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    assert len(payload) < LIMIT, len(payload)
    done = threading.Event()
    worst = [0.0]

    def watch() -> None:
        with httpx.Client(base_url=router.base_url, timeout=30) as h:
            while not done.is_set():
                started = time.monotonic()
                assert h.get("/health").status_code == 200
                worst[0] = max(worst[0], time.monotonic() - started)
                time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.2)
    started = time.monotonic()
    answer = httpx.post(router.base_url + path, content=payload, timeout=120,
                        headers={"content-type": "application/json"})
    took = time.monotonic() - started
    time.sleep(0.2)
    done.set()
    watcher.join(30)
    return answer, took, worst[0]


CASES = {
    "detokenize 3.9M ids": ("/detokenize", {"model": MODEL, "tokens": [1] * 3_900_000}),
    # large answers: 2.6M characters of text; 680k token ids (and as many token strings)
    "detokenize 2.6M ids of text": ("/detokenize", {
        "model": MODEL, "tokens": [10 + i % 90 for i in range(2_600_000)]}),
    "tokenize a 4 MB prompt": ("/tokenize", {"model": MODEL, "prompt": "hello world " * 340_000,
                                             "return_token_strs": True}),
    "completion of 2.6M token ids": ("/v1/completions", {"model": MODEL, "max_tokens": 1,
                                                         "prompt": [1] * 2_600_000}),
    "chat of 230k messages": ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "a"}] * 230_000}),
    "completion of 1M ids with one bad id": ("/v1/completions", {
        "model": MODEL, "max_tokens": 1, "prompt": [1] * 1_000_000 + [True]}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_health_answers_fast_during_a_big_body(router: EdgeRouter, name: str) -> None:
    path, body = CASES[name]
    answer, took, worst = health_during(router, path, body)
    print(f"{router.mode}: {name}: {answer.status_code} in {took:.2f} s; slowest /health "
          f"{worst * 1000:.0f} ms")
    assert answer.status_code < 500, answer.text[:300]
    if name.startswith(("detokenize", "tokenize")):
        assert answer.status_code == 200
        if name == "detokenize 2.6M ids of text":
            assert len(answer.json()["prompt"]) > 1_000_000
        if name.startswith("tokenize"):
            got = answer.json()
            assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) > 600_000
    else:
        assert answer.status_code == 400, answer.text[:300]
        err = answer.json()["error"]
        assert err["param"] in ("prompt", "messages", "prompt[1000000]"), err
    if router.mode == "off-loop":
        # the goal is 0.1 s; on the shared 2-core build host (docs/edge.md) the slowest was
        # 0.26-0.77 s against 4.4-14 s on the loop, so the bound here leaves room for the host
        assert worst < 1.0, worst
