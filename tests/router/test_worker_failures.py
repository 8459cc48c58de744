"""Worker trouble ends in a clear answer: 503 when down, 429 when full, deadlines, and Abort when
the client goes away mid-stream."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import openai
import pytest

from tests.router.conftest import MODEL, Cluster, start_cluster
from tests.router.router_fakes import CRASHED, SCRIPT, LoopThread, TinyTokenizer

pytestmark = pytest.mark.timeout(120)   # a hang is a failure, never a stuck CI

MESSAGES = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "Hello world! The quick brown fox jumps over the lazy dog. " * 4


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def closed_port_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def slow(loop_thread: LoopThread, tok: TinyTokenizer) -> Iterator[Cluster]:
    with start_cluster(loop_thread, tok, worker_kw={"token_delay_s": 0.1},
                       first_token_timeout_s=5.0, stream_idle_timeout_s=5.0) as c:
        yield c


def test_no_worker_up_is_503_with_retry_after(loop_thread: LoopThread,
                                              tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, num_prefill=0, num_decode=0,
                       extra_decode_addresses=(closed_port_address(),), retry_after_s=3) as c:
        with c.http() as h:
            r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "no_worker_available"
            health = h.get("/health")
            assert health.status_code == 503 and health.headers["retry-after"] == "3"
            assert "GetInfo failed" in str(health.json()["workers"])
        with pytest.raises(openai.InternalServerError) as e:
            c.client().completions.create(model=MODEL, prompt="hi", stream=True)
        assert e.value.status_code == 503


def test_worker_that_dies_gives_503_then_recovers_nothing_hangs(loop_thread: LoopThread,
                                                                tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, num_decode=2) as c:
        client = c.client(timeout=10.0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        # stop one decode worker: requests keep working on the other one
        dead = c.decode[0]
        loop_thread.run(c.servers[1].stop(grace=None))
        for _ in range(4):
            r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.choices[0].finish_reason == "length"
        # stop the other: a clear 503, not a hang
        loop_thread.run(c.servers[2].stop(grace=None))
        started = time.monotonic()
        with c.http() as h:
            codes = {h.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code
                     for _ in range(3)}
        assert codes == {503} and time.monotonic() - started < 5
        assert dead.address  # the first dead worker was skipped, not retried forever


def test_resource_exhausted_is_429(reset: Cluster) -> None:
    reset.decode[0].exhausted = True
    with reset.http() as h:
        for stream in (False, True):
            r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                     "stream": stream})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
    reset.decode[0].exhausted = False
    reset.prefill[0].exhausted = True
    with pytest.raises(openai.RateLimitError):
        reset.client().completions.create(model=MODEL, prompt=LONG_PROMPT)
    reset.prefill[0].exhausted = False
    assert reset.healthy()
    assert reset.client().completions.create(model=MODEL, prompt=LONG_PROMPT).choices


def test_client_disconnect_mid_stream_aborts_the_worker(slow: Cluster) -> None:
    with httpx.Client(base_url=slow.base_url, timeout=10) as h, h.stream(
            "POST", "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True,
                  "ignore_eos": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
    decode = slow.decode[0]
    (gen,) = decode.generates
    assert wait_for(lambda: gen.request_id in decode.aborts), decode.aborts
    assert wait_for(lambda: gen.request_id in decode.cancelled)
    assert gen.request_id not in decode.completed
    assert slow.healthy()
    assert wait_for(lambda: slow.router_inflight() == 0)


def test_client_disconnect_during_prefill_and_non_stream(slow: Cluster) -> None:
    with httpx.Client(base_url=slow.base_url, timeout=0.05) as h, \
            pytest.raises(httpx.TimeoutException):
        h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 100,
                                        "ignore_eos": True})
    decode = slow.decode[0]
    assert wait_for(lambda: len(decode.generates) == 1)
    rid = decode.generates[0].request_id
    assert wait_for(lambda: rid in decode.aborts and rid in decode.cancelled)
    prefill = slow.prefill[0]
    prefill.token_delay_s = 1.0
    with httpx.Client(base_url=slow.base_url, timeout=0.3) as h, \
            pytest.raises(httpx.TimeoutException):
        h.post("/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "stream": True})
    assert wait_for(lambda: len(prefill.prefills) == 1)
    rid = prefill.prefills[0].request_id
    assert wait_for(lambda: rid in prefill.aborts)
    time.sleep(1.2)
    assert all(g.request_id != rid for g in decode.generates)   # never reached decode
    assert slow.router_inflight() == 0


def test_first_token_deadline(loop_thread: LoopThread, tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, worker_kw={"token_delay_s": 2.0},
                           first_token_timeout_s=0.3) as c:
        started = time.monotonic()
        with c.http() as h:
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 504 and r.json()["error"]["code"] == "first_token_timeout"
        assert "first_token" in r.json()["error"]["message"]
        assert time.monotonic() - started < 2.0
        rid = c.decode[0].generates[0].request_id
        assert wait_for(lambda: rid in c.decode[0].aborts)


def test_incompatible_or_misrouted_workers_are_refused(
        reset: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    from proto import bulkhead_pb2 as pb

    prefill, decode = reset.prefill[0], reset.decode[0]
    good = prefill.compat
    client = reset.client()
    try:
        prefill.compat = pb.Compatibility(**{**{f.name: getattr(good, f.name) for f in
                                                good.DESCRIPTOR.fields}, "dtype": "bfloat16"})
        with caplog.at_level("WARNING", logger="bulkhead.router.registry"):
            assert wait_for(lambda: "dtype: 'bfloat16' != 'float32'" in caplog.text), caplog.text
        r = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        assert r.choices[0].text  # served whole by the decode worker, never handed over
        assert prefill.prefills == [] and not decode.generates[-1].has_prefill
        prefill.compat = good
        time.sleep(0.7)   # one poll
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        assert len(prefill.prefills) == 1 and decode.generates[-1].has_prefill
        # a worker that reports another role than the one it is configured as is refused
        decode.role = "prefill"
        assert wait_for(lambda: not reset.healthy())
        with reset.http() as h:
            body = h.get("/health").json()
        assert "reports role 'prefill', configured as 'decode'" in str(body)
    finally:
        prefill.compat = good
        decode.role = "decode"
    assert wait_for(reset.healthy)


def test_error_mapping_is_one_table() -> None:
    import grpc

    from router.errors import WorkerCallError, from_worker_error

    cases = {grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "queue_full"),
             grpc.StatusCode.UNAVAILABLE: (503, "worker_unavailable"),
             grpc.StatusCode.DEADLINE_EXCEEDED: (504, "prefill_timeout"),
             grpc.StatusCode.FAILED_PRECONDITION: (400, "context_length_exceeded"),
             grpc.StatusCode.OUT_OF_RANGE: (400, "context_length_exceeded"),
             grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_argument"),
             grpc.StatusCode.INTERNAL: (502, "worker_error")}
    for code, (status, name) in cases.items():
        err = from_worker_error(WorkerCallError("w:1", "prefill", code, "detail"), 7)
        assert (err.status, err.code) == (status, name)
        assert ("Retry-After" in err.headers()) == (status in (429, 503))
        assert "w:1" in err.message and "prefill" in err.message
        assert err.param is None


def test_a_field_the_engine_named_becomes_the_errors_param() -> None:
    """worker.codec.status_of ends INVALID_ARGUMENT details with " (field NAME)"; the client
    gets NAME as the error's param, and the message without the suffix."""
    import grpc

    from engine.errors import InvalidRequest
    from router.errors import WorkerCallError, from_worker_error
    from worker.codec import status_of

    status = status_of(InvalidRequest("response_format: cannot build a grammar from it",
                                      field="response_format"))
    err = from_worker_error(WorkerCallError("w:1", "first_token", status.code, status.message), 7)
    assert (err.status, err.param) == (400, "response_format")
    assert err.message.endswith("cannot build a grammar from it")
    plain = from_worker_error(WorkerCallError("w:1", "first_token", grpc.StatusCode.INVALID_ARGUMENT,
                                              "a (field) in prose, not a suffix"), 7)
    assert plain.param is None and plain.message.endswith("not a suffix")


def test_worker_failing_mid_stream_ends_the_stream_with_an_error(reset: Cluster) -> None:
    reset.decode[0].fail_after = 3
    client = reset.client()
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=50, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="unavailable"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert "".join(texts) == reset.tok.decode(reset.tok.encode(
        " The answer is 42. END of the story, ça va?", add_special_tokens=False)[:3])
    with pytest.raises(openai.InternalServerError) as e:   # non-stream: a 503 answer
        client.completions.create(model=MODEL, prompt="hi", max_tokens=50)
    assert e.value.status_code == 503
    reset.decode[0].fail_after = -1
    assert wait_for(reset.healthy)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


def test_unreachable_prefill_worker_falls_back_to_decode(loop_thread: LoopThread,
                                                         tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, poll_interval_s=60.0) as c:   # no poll notices the death
        loop_thread.run(c.servers[0].stop(grace=None))             # the prefill worker
        r = c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        assert r.choices[0].text == SCRIPT and r.choices[0].finish_reason == "stop"
        (gen,) = c.decode[0].generates
        assert not gen.has_prefill and c.prefill[0].prefills == []
        assert c.healthy()   # the decode worker still serves


def test_router_admission_bound_gives_429(loop_thread: LoopThread, tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, worker_kw={"token_delay_s": 0.2},
                           max_inflight_requests=1, retry_after_s=2) as c:
        with httpx.Client(base_url=c.base_url, timeout=10) as h, h.stream(
                "POST", "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}) as s:
            assert s.status_code == 200
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 429 and r.headers["retry-after"] == "2"
            assert "max_inflight_requests=1" in r.json()["error"]["message"]
            assert list(s.iter_lines())[-2] == "data: [DONE]"
        with httpx.Client(base_url=c.base_url, timeout=10) as h:   # the slot is free again
            r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200


def test_disconnect_aborts_every_choice_of_a_stream(slow: Cluster) -> None:
    with httpx.Client(base_url=slow.base_url, timeout=10) as h, h.stream(
            "POST", "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "n": 3, "stream": True,
                  "max_tokens": 100, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    decode = slow.decode[0]
    # the fair share of its 4 slots (router/policy.py choice_share) runs 2 choices at once: the
    # third was waiting for one of them and never starts
    assert wait_for(lambda: len(decode.generates) == 2)
    time.sleep(0.3)
    assert len(decode.generates) == 2
    ids = {g.request_id for g in decode.generates}
    assert wait_for(lambda: ids <= set(decode.aborts) and ids <= set(decode.cancelled))
    assert not ids & set(decode.completed)
    assert wait_for(lambda: slow.router_inflight() == 0)


def test_failed_prefill_is_retried_once_on_another_prefill_worker(loop_thread: LoopThread,
                                                                   tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, num_prefill=2) as c:
        # equal loads: the policy picks the lowest address first; that one breaks
        first = min(c.prefill, key=lambda w: w.address)
        second = max(c.prefill, key=lambda w: w.address)
        first.prefill_error = grpc.StatusCode.DEADLINE_EXCEEDED  # hung
        r = c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        assert r.choices[0].text == SCRIPT
        assert len(first.prefills) == 1 and len(second.prefills) == 1
        assert c.decode[0].generates[-1].has_prefill  # the retry's KV went to the decode worker

        # both broken: the decode worker prefills the prompt itself, the answer is still right
        second.prefill_error = grpc.StatusCode.UNAVAILABLE
        r = c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        assert r.choices[0].text == SCRIPT
        assert not c.decode[0].generates[-1].has_prefill

        # an error the request itself causes is answered, not retried elsewhere; so is
        # INTERNAL, a worker that is up and whose step raised for this request
        for code, error in ((grpc.StatusCode.OUT_OF_RANGE, openai.BadRequestError),
                            (grpc.StatusCode.INTERNAL, openai.APIStatusError)):
            first.prefill_error = second.prefill_error = code
            before = len(first.prefills) + len(second.prefills)
            decodes = len(c.decode[0].generates)
            with pytest.raises(error):
                c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
            assert len(first.prefills) + len(second.prefills) == before + 1
            assert len(c.decode[0].generates) == decodes
        assert c.healthy()


def test_a_request_whose_worker_dies_under_it_is_not_retried_and_is_quarantined(
        loop_thread: LoopThread, tok: TinyTokenizer) -> None:
    with start_cluster(loop_thread, tok, num_prefill=2) as c:
        first = min(c.prefill, key=lambda w: w.address)  # equal loads: the policy's pick
        first.prefill_error = grpc.StatusCode.UNAVAILABLE
        first.prefill_error_details = CRASHED
        with pytest.raises(openai.InternalServerError) as e:
            c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        body = e.value.body
        assert e.value.status_code == 500 and body["code"] == "request_quarantined"
        assert "died while running it, the only request running there" in body["message"]
        # not replayed on the other prefill worker, nor prefilled by the decode worker
        assert sum(len(w.prefills) for w in c.prefill) == 1
        assert c.decode[0].generates == []
        # the same request again: refused at once, no worker sees it
        first.prefill_error = None
        with pytest.raises(openai.InternalServerError) as e:
            c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
        assert "quarantined" in e.value.body["message"] and "600 s" in e.value.body["message"]
        assert sum(len(w.prefills) for w in c.prefill) == 1
        # the same prompt with other sampling parameters, and other prompts, are served
        r = c.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=49)
        assert r.choices[0].text
        r = c.client().completions.create(model=MODEL, prompt=LONG_PROMPT + " more", max_tokens=5)
        assert r.choices[0].text
        with c.http() as h:
            metrics = h.get("/metrics").text
        assert 'bulkhead_worker_crash_calls_total{verdict="blamed"} 1.0' in metrics
