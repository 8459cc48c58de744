"""The official openai client against the real router (uvicorn, 127.0.0.1) and fake gRPC workers."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from router.settings import SettingsError
from router.tokenizer_port import with_chat_template_file
from tests.router.conftest import MODEL, Cluster, start_cluster
from tests.router.router_fakes import SCRIPT, LoopThread, TinyTokenizer

pytestmark = pytest.mark.timeout(120)   # a hang is a failure, never a stuck CI

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = "Hello world! The quick brown fox jumps over the lazy dog. " * 4   # > 32 tokens


def chat_prompt_ids(c: Cluster, messages: list[dict[str, str]] = MESSAGES) -> list[int]:
    return c.tok.encode(c.tok.apply_chat_template(messages), add_special_tokens=False)


def script_ids(c: Cluster) -> list[int]:
    return c.tok.encode(SCRIPT, add_special_tokens=False)


def test_chat_non_stream(reset: Cluster) -> None:
    r = reset.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100)
    assert r.choices[0].message.content == SCRIPT
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(chat_prompt_ids(reset))
    assert r.usage.completion_tokens == len(script_ids(reset)) + 1   # the EOS counts
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    (gen,) = reset.decode[0].generates
    assert list(gen.prompt_token_ids) == chat_prompt_ids(reset) and not gen.has_prefill
    assert gen.request_id == f"{r.id}-0"   # one id from the client's answer to the worker
    assert set(gen.sampling.stop_token_ids) == set(reset.tok.eos_token_ids)


def test_chat_stream_with_usage(reset: Cluster) -> None:
    stream = reset.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == SCRIPT
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        len(script_ids(reset)) + 1
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_ids_and_lists(reset: Cluster) -> None:
    client = reset.client()
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4)
    ids = script_ids(reset)
    assert r.choices[0].text == reset.tok.decode(ids[:4])
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    prompt_ids = reset.tok.encode("Hello world", add_special_tokens=False)
    r2 = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=4)
    assert r2.choices[0].text == r.choices[0].text
    assert r2.usage.prompt_tokens == len(prompt_ids)
    r3 = client.completions.create(model=MODEL, prompt=["Hello", "world peace"], max_tokens=3,
                                   n=2)
    assert [c.index for c in r3.choices] == [0, 1, 2, 3]
    assert r3.usage.prompt_tokens == len(reset.tok.encode("Hello")) + len(
        reset.tok.encode("world peace"))
    assert r3.usage.completion_tokens == 12
    got = sorted(list(g.prompt_token_ids) for g in reset.decode[0].generates[2:])
    assert got == sorted([reset.tok.encode("Hello")] * 2 + [reset.tok.encode("world peace")] * 2)


def test_n_independent_choices_streaming(reset: Cluster) -> None:
    stream = reset.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=7, stream=True, max_completion_tokens=6)
    texts = {0: "", 1: ""}
    finishes = {}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    expected = reset.tok.decode(script_ids(reset)[:6])
    assert texts == {0: expected, 1: expected} and finishes == {0: "length", 1: "length"}
    gens = reset.decode[0].generates
    assert len(gens) == 2 and {g.request_id for g in gens} != {gens[0].request_id}
    assert sorted(g.sampling.seed for g in gens) == [7, 8]
    assert all(g.sampling.max_tokens == 6 for g in gens)


def test_n_non_stream(reset: Cluster) -> None:
    r = reset.client().chat.completions.create(model=MODEL, messages=MESSAGES, n=3,
                                               max_tokens=100)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == SCRIPT for c in r.choices)
    assert r.usage.completion_tokens == 3 * (len(script_ids(reset)) + 1)
    assert r.usage.prompt_tokens == len(chat_prompt_ids(reset))


def test_stop_strings_cut_text_and_abort_the_worker(reset: Cluster) -> None:
    client = reset.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["END", "zzz"])
    assert r.choices[0].message.content == SCRIPT[:SCRIPT.index("END")]
    assert r.choices[0].finish_reason == "stop"
    rid = reset.decode[0].generates[-1].request_id
    deadline = time.monotonic() + 5
    while rid not in reset.decode[0].aborts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in reset.decode[0].aborts
    # streamed: the same cut, and nothing after the stop string leaks out
    stream = client.completions.create(model=MODEL, prompt="Hi", stop=" story", stream=True,
                                       max_tokens=50)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == SCRIPT[:SCRIPT.index(" story")]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_and_sampling_are_forwarded(reset: Cluster) -> None:
    client = reset.client()
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0.5, top_p=0.9,
        seed=11, extra_body={"top_k": 5, "ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    sp = reset.decode[0].generates[-1].sampling
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.ignore_eos) == (3, 5, 11, True)
    assert abs(sp.temperature - 0.5) < 1e-6 and abs(sp.top_p - 0.9) < 1e-6
    assert list(sp.stop_token_ids) == []   # ignore_eos: the EOS is not a stop token
    # ignore_eos runs past the script's end
    n = len(script_ids(reset)) + 5
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=n,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_return_token_ids(reset: Cluster) -> None:
    client = reset.client()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == chat_prompt_ids(reset)
    assert r.choices[0].model_extra["token_ids"] == script_ids(reset)[:5]
    rc = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                   extra_body={"return_token_ids": True})
    assert rc.choices[0].model_extra["prompt_token_ids"] == reset.tok.encode("Hello")
    assert rc.choices[0].model_extra["token_ids"] == script_ids(reset)[:3]
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                                       extra_body={"return_token_ids": True})
    ids: list[int] = []
    for c in stream:
        ids += c.choices[0].model_extra["token_ids"]
    assert ids == script_ids(reset)[:3]


def test_long_uncached_prompt_is_split(reset: Cluster) -> None:
    client = reset.client()
    r = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50)
    assert r.choices[0].text == SCRIPT   # the first token (from prefill) appears exactly once
    prompt = reset.tok.encode(LONG_PROMPT)
    assert len(prompt) >= 32
    (pre,) = reset.prefill[0].prefills
    (gen,) = reset.decode[0].generates
    assert list(pre.prompt_token_ids) == prompt and pre.request_id == gen.request_id
    assert gen.has_prefill and gen.first_token_id == script_ids(reset)[0]
    assert gen.kv.num_tokens_stored == len(prompt)
    assert reset.decode[0].lookups == 1
    # streamed: the prefill's token arrives first, then the decode stream continues
    stream = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=50,
                                       stream=True)
    texts = [c.choices[0].text for c in stream]
    assert "".join(texts) == SCRIPT and texts[0] == reset.tok.decode(script_ids(reset)[:1])


def test_split_that_ends_at_the_first_token(reset: Cluster) -> None:
    r = reset.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=1)
    assert r.choices[0].text == reset.tok.decode(script_ids(reset)[:1])
    assert r.choices[0].finish_reason == "length"
    assert len(reset.prefill[0].prefills) == 1 and reset.decode[0].generates == []


def test_cached_or_short_prompts_stay_on_decode(reset: Cluster) -> None:
    client = reset.client()
    client.completions.create(model=MODEL, prompt="Hello world", max_tokens=2)
    assert reset.decode[0].lookups == 0   # too short to split: no lookup at all
    reset.decode[0].num_cached = 1000
    r = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert reset.prefill[0].prefills == [] and len(reset.decode[0].generates) == 2
    assert not reset.decode[0].generates[-1].has_prefill
    assert r.choices[0].text == reset.tok.decode(script_ids(reset)[:2])


def test_models_health_metrics(reset: Cluster) -> None:
    models = reset.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512
    reset.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3)
    with httpx.Client(base_url=reset.base_url) as h:
        health = h.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        text = h.get("/metrics").text
    for name in ("bulkhead_time_to_first_token_seconds_count",
                 "bulkhead_inter_token_latency_seconds_count",
                 "bulkhead_e2e_request_latency_seconds_count",
                 'bulkhead_phase_seconds_count{phase="prefill"}',
                 'bulkhead_requests_total{outcome="ok"}',
                 'bulkhead_prompt_tokens_total{source="loaded"}',
                 'bulkhead_prompt_tokens_total{source="recomputed"}',
                 "bulkhead_worker_queue_depth{", 'bulkhead_routes_total{route="split"}'):
        assert name in text, name
    loaded = next(line for line in text.splitlines()
                  if line.startswith('bulkhead_prompt_tokens_total{source="loaded"}'))
    assert float(loaded.split()[-1]) >= len(reset.tok.encode(LONG_PROMPT))


def test_concurrent_requests_are_each_correct_and_spread(loop_thread: LoopThread,
                                                         tok: TinyTokenizer) -> None:
    c = start_cluster(loop_thread, tok, num_decode=2, worker_kw={"token_delay_s": 0.01})
    try:
        client = c.client()
        ids = script_ids(c)

        def one(i: int) -> tuple[int, str, str | None]:
            n = 1 + i % 7
            r = client.completions.create(model=MODEL, prompt=f"Hello {i}", max_tokens=n)
            return n, r.choices[0].text, r.choices[0].finish_reason

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(24)))
        for n, text, reason in results:
            assert text == c.tok.decode(ids[:n]) and reason == "length"
        counts = [len(w.generates) for w in c.decode]
        assert sum(counts) == 24 and min(counts) >= 6, counts   # least-loaded spreads them
    finally:
        c.close()


def test_request_id_header_matches_the_body_and_the_worker(reset: Cluster) -> None:
    with reset.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.headers["x-request-id"] == r.json()["id"]
        with h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                       "max_tokens": 2, "stream": True}) as s:
            rid = s.headers["x-request-id"]
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and f'"id":"{rid}"' in lines[0]
    assert reset.decode[0].generates[-1].request_id == f"{rid}-0"


def test_tokenizer_and_chat_template_load_from_the_model_folder(
        loop_thread: LoopThread, tok: TinyTokenizer, tmp_path: Path) -> None:
    tok.save_hf_folder(tmp_path)
    c = start_cluster(loop_thread, tok, model_path=str(tmp_path))
    try:
        r = c.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100)
        assert r.choices[0].message.content == SCRIPT and r.choices[0].finish_reason == "stop"
        (gen,) = c.decode[0].generates
        assert list(gen.prompt_token_ids) == chat_prompt_ids(c)
        assert set(gen.sampling.stop_token_ids) == {tok.eos_token_ids[0]}   # <eos> from config
    finally:
        c.close()


def test_chat_template_file_overrides_the_models(loop_thread: LoopThread, tok: TinyTokenizer,
                                                 tmp_path: Path) -> None:
    """--chat-template FILE: the router renders with it, tools included, and auto then reads
    the syntax that template teaches."""
    tok.save_hf_folder(tmp_path)
    template = tmp_path / "tools.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if tools %}<tool_call> {{ tools | length }} tools\n{% endif %}")
    c = start_cluster(loop_thread, tok, model_path=str(tmp_path), chat_template=str(template))
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        c.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                           tools=tools)
        (gen,) = c.decode[0].generates
        prompt = tok.decode(list(gen.prompt_token_ids))
        assert prompt.startswith(f"[{MESSAGES[0]['role']}] ") and "<tool_call> 1 tools" in prompt
        assert json.loads(gen.sampling.grammar_spec)["format"] == "qwen_3"
    finally:
        c.close()
    with pytest.raises(SettingsError, match="chat_template"):
        with_chat_template_file(tok_from(tmp_path), str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_text("{% for %}")
    with pytest.raises(SettingsError, match="does not compile"):
        with_chat_template_file(tok_from(tmp_path), str(tmp_path / "bad.jinja"))


def tok_from(folder: Path):
    from common.tokenizer import Tokenizer

    return Tokenizer.from_path(folder)


def _scrape(c: Cluster) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=c.base_url) as h:
        text = h.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_vllm_request_series(reset: Cluster) -> None:
    """vLLM's per-request histograms, preemption counter and cache config, with model_name."""
    from tests.router.router_fakes import PREFILL_S, QUEUE_S

    m = (("model_name", MODEL),)
    before = _scrape(reset)
    r = reset.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    after = _scrape(reset)

    def grew(name: str) -> float:
        return after[(name, m)] - before.get((name, m), 0.0)

    assert grew("vllm:request_prompt_tokens_count") == 1
    assert grew("vllm:request_prompt_tokens_sum") == r.usage.prompt_tokens
    assert grew("vllm:request_generation_tokens_sum") == r.usage.completion_tokens
    assert grew("vllm:request_queue_time_seconds_sum") == pytest.approx(QUEUE_S)
    assert grew("vllm:request_prefill_time_seconds_sum") == pytest.approx(PREFILL_S)
    assert grew("vllm:request_decode_time_seconds_count") == 1
    assert grew("vllm:request_decode_time_seconds_sum") >= 0
    workers = {dict(labels)["engine"]: (dict(labels), v) for (name, labels), v in after.items()
               if name == "vllm:cache_config_info"}
    labels, value = workers[reset.decode[0].address]
    assert value == 1 and labels["block_size"] == "16" and labels["model_name"] == MODEL
    assert labels["num_gpu_blocks"] == "0" and labels["cache_dtype"] == "float32"
    assert any(name == "vllm:num_preemptions_total" for name, _ in after)


def test_one_requests_n_runs_at_most_half_the_decode_slots_at_once(reset: Cluster) -> None:
    """Fair share (router/policy.py choice_share): the fake decode worker has 4 slots, so a
    request runs 2 of its choices at once and starts the next as one ends; all are answered."""
    reset.decode[0].token_delay_s = 0.01
    r = reset.client().chat.completions.create(model=MODEL, messages=MESSAGES, n=6,
                                               max_completion_tokens=5)
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert all(c.finish_reason == "length" for c in r.choices)
    assert reset.decode[0].max_generating == 2
