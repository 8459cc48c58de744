"""End to end with the official openai client against router + prefill + decode processes and a
real redis-server: greedy output equals transformers on both routes (a long prompt spanning
several LMCache chunks, its KV loaded by the decode worker), chat and completions, streaming and
not, 8 concurrent requests, and bad inputs answered clearly with the server healthy after."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.conftest import CHUNK, E2E, MAX_CONTEXT, SPLIT_THRESHOLD
from tests.helpers.tiny_model import hf_greedy


def token_prompt(n: int, seed: int) -> list[int]:
    return [(seed * 41 + 13 * i) % 300 + 4 for i in range(n)]


def complete_ids(e2e: E2E, prompt: list[int], max_tokens: int, stream: bool) -> tuple[list[int], dict]:
    client = e2e.client()
    extra = {"return_token_ids": True}
    if not stream:
        resp = client.completions.create(model=e2e.model, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, extra_body=extra)
        return list(resp.choices[0].token_ids), resp.usage.model_dump()
    ids: list[int] = []
    usage: dict = {}
    for chunk in client.completions.create(model=e2e.model, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body=extra):
        for choice in chunk.choices:
            ids += list(getattr(choice, "token_ids", None) or [])
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return ids, usage


@pytest.mark.parametrize("stream", [False, True])
def test_long_prompt_takes_the_split_route_and_decode_loads_its_kv(e2e: E2E, stream: bool) -> None:
    n = 5 * CHUNK + 7  # 87 tokens: several chunks, the last one partial
    assert n >= SPLIT_THRESHOLD and n % CHUNK
    prompt = token_prompt(n, seed=1 if stream else 2)
    loaded_before = e2e.metric("bulkhead_prompt_tokens_total", source="loaded")
    split_before = e2e.metric("bulkhead_time_to_first_token_seconds_count", route="split")
    ids, usage = complete_ids(e2e, prompt, 12, stream)
    assert ids == hf_greedy(e2e.folder, prompt, 12)
    assert usage["prompt_tokens"] == n and usage["completion_tokens"] == len(ids)
    assert e2e.metric("bulkhead_time_to_first_token_seconds_count", route="split") == \
        split_before + 1
    # The decode worker loaded the KV of the prompt's whole blocks (16 tokens, the workers'
    # --block-size) from LMCache/Redis; the partial last block is recomputed.
    assert e2e.metric("bulkhead_prompt_tokens_total", source="loaded") == loaded_before + n // 16 * 16


@pytest.mark.parametrize("stream", [False, True])
def test_short_prompt_runs_on_the_decode_worker(e2e: E2E, stream: bool) -> None:
    prompt = token_prompt(9, seed=3 if stream else 4)
    decode_before = e2e.metric("bulkhead_time_to_first_token_seconds_count", route="decode")
    ids, _ = complete_ids(e2e, prompt, 10, stream)
    assert ids == hf_greedy(e2e.folder, prompt, 10)
    assert e2e.metric("bulkhead_time_to_first_token_seconds_count", route="decode") == \
        decode_before + 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("words", [1, 10])  # short: decode route; long: split route
def test_chat_matches_transformers(e2e: E2E, stream: bool, words: int) -> None:
    content = " ".join(["the quick brown fox"] * words) + f" {words}{stream}"
    messages = [{"role": "user", "content": content}]
    client = e2e.client()
    extra = {"return_token_ids": True}
    if not stream:
        resp = client.chat.completions.create(model=e2e.model, messages=messages, max_tokens=8,
                                              temperature=0, extra_body=extra)
        body = resp.model_dump()
        prompt_ids, ids = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        text = resp.choices[0].message.content
    else:
        prompt_ids, ids, text = [], [], ""
        for chunk in client.chat.completions.create(model=e2e.model, messages=messages,
                                                    max_tokens=8, temperature=0, stream=True,
                                                    extra_body=extra):
            d = chunk.model_dump()
            prompt_ids = d.get("prompt_token_ids") or prompt_ids
            for choice in d["choices"]:
                ids += choice.get("token_ids") or []
                text += (choice.get("delta") or {}).get("content") or ""
    assert (len(prompt_ids) >= SPLIT_THRESHOLD) == (words == 10)
    assert ids == hf_greedy(e2e.folder, prompt_ids, 8)
    from common.tokenizer import Tokenizer

    assert text == Tokenizer.from_path(e2e.folder).decode(ids)


def test_eight_concurrent_requests_each_correct(e2e: E2E) -> None:
    prompts = [token_prompt(n, seed=10 + i) for i, n in
               enumerate([5, 50, 17, 90, 33, 64, 8, 120])]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: complete_ids(e2e, p, 10, False)[0], prompts))
    for prompt, ids in zip(prompts, results, strict=True):
        assert ids == hf_greedy(e2e.folder, prompt, 10)


def post(e2e: E2E, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(e2e.deployment.url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bad_inputs_get_clear_errors_and_the_server_stays_healthy(e2e: E2E) -> None:
    client = e2e.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=e2e.model, prompt=token_prompt(MAX_CONTEXT, 5),
                                  max_tokens=10)
    assert err.value.code == "context_length_exceeded"
    assert str(MAX_CONTEXT) in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=e2e.model, prompt="hi", max_tokens=-1)
    assert "max_tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=e2e.model, messages=[{"role": "user",
                                       "content": "hi"}], temperature=-3)
    assert "temperature" in err.value.message
    status, body = post(e2e, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["message"]
    status, body = post(e2e, "/v1/completions",
                        json.dumps({"model": e2e.model, "prompt": [5, 10**7]}).encode())
    assert status == 400 and body["error"]["message"]
    # Still serving, and still right.
    with urllib.request.urlopen(e2e.deployment.url + "/health", timeout=5) as resp:
        assert resp.status == 200
    prompt = token_prompt(60, 6)
    assert complete_ids(e2e, prompt, 5, False)[0] == hf_greedy(e2e.folder, prompt, 5)


def test_store_urls_stay_off_command_lines(e2e: E2E) -> None:
    """A Redis URL can carry a password: `bulkhead up` hands it to the children through their
    environment, so no command line (readable by every user through `ps`) shows it."""
    procs = e2e.deployment.group.processes
    assert any(p.env.get("BULKHEAD_KV_STORE_URL") == e2e.deployment.kv_store_url for p in procs)
    for p in procs:
        assert not any("redis://" in a or "rediss://" in a for a in p.argv), (p.name, p.argv)
