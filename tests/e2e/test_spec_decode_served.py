"""End to end with ``bulkhead up --speculative-method ngram --num-speculative-tokens 3``: router,
prefill and decode processes and a real redis-server on the tiny Llama, the decode worker
verifying n-gram drafts. Greedy answers on both routes (the decode worker alone, and split
after a prefill) equal the product's engine without speculation token for token; drafts were
verified and accepted (vLLM's spec_decode counters on /metrics); a stop string cuts a step's
several tokens where one token a step would have; the request field overrides the worker's k
and is refused above it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch

from tests.e2e.conftest import E2E, MAX_CONTEXT, SPLIT_THRESHOLD, deploy
from tests.helpers.engine_greedy import engine_greedy

# repeats itself: the tiny random model's greedy continuation loops on it, where drafts hit
SHORT = [11, 40, 41, 42, 43, 12] * 3
LONG = [(7 * i) % 200 + 20 for i in range(SPLIT_THRESHOLD + 8)] + SHORT


@pytest.fixture(scope="module")
def e2e_spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    yield from deploy(tmp_path_factory, speculative_method="ngram", num_speculative_tokens=3)


def plain_engine_greedy(e2e: E2E, prompt: list[int], n: int) -> list[int]:
    """The engine the workers run, in this process, with the workers' flags and no drafts."""
    from engine.checkpoint import load_checkpoint
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    ckpt = load_checkpoint(e2e.folder, dtype=torch.float32, progress=False)
    ec = EngineConfig(model=str(e2e.folder), device="cpu", dtype="float32",
                      max_context=MAX_CONTEXT, chunk_tokens=48, max_batch=8, block_size=16,
                      attn_tile_tokens=64)
    engine = LLMEngine(ec, ckpt.config, ckpt.state_dict, ckpt.model_fingerprint)
    return engine_greedy(engine, prompt, n)


def complete(e2e: E2E, prompt: list[int], n: int, stream: bool, **extra: object) -> list[int]:
    client = e2e.client()
    body = {"return_token_ids": True, "ignore_eos": True, **extra}
    if not stream:
        resp = client.completions.create(model=e2e.model, prompt=prompt, max_tokens=n,
                                         temperature=0, extra_body=body)
        return list(resp.choices[0].token_ids)
    ids: list[int] = []
    for chunk in client.completions.create(model=e2e.model, prompt=prompt, max_tokens=n,
                                           temperature=0, stream=True, extra_body=body):
        for choice in chunk.choices:
            ids += list(getattr(choice, "token_ids", None) or [])
    return ids


def test_only_the_decode_worker_plans_verify_rows(e2e_spec: E2E) -> None:
    logs = {role: (e2e_spec.deployment.log_dir / f"{role}.log").read_text()
            for role in ("prefill", "decode")}
    assert "warm-up" in logs["decode"] and "verify 8 sequence(s)" in logs["decode"], \
        logs["decode"][-2000:]
    assert "verify" not in logs["prefill"]


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_answers_equal_the_plain_engine_and_drafts_are_accepted(e2e_spec: E2E,
                                                                        stream: bool) -> None:
    drafts = e2e_spec.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = e2e_spec.metric("vllm:spec_decode_num_accepted_tokens_total")
    for prompt in (SHORT, LONG):
        got = complete(e2e_spec, prompt, 48, stream)
        assert got == plain_engine_greedy(e2e_spec, prompt, 48)
    import time

    time.sleep(1.5)  # the router's poll of GetInfo (0.5 s here) brings the counters
    assert e2e_spec.metric("vllm:spec_decode_num_draft_tokens_total") > drafts
    assert e2e_spec.metric("vllm:spec_decode_num_accepted_tokens_total") > accepted
    assert e2e_spec.metric("vllm:spec_decode_num_drafts_total") > 0
    assert e2e_spec.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                           position="0") > 0


def test_a_stop_string_cuts_inside_a_verify_step(e2e_spec: E2E) -> None:
    """The stop string is the text of a token in the middle of the greedy answer: the answer
    ends before it as with one token a step, and the tokens after it are not reported."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(e2e_spec.folder / "tokenizer.json"))
    full = plain_engine_greedy(e2e_spec, SHORT, 40)
    text = tok.decode(full)
    # a stop string that first appears well inside the answer
    stop = next(text[i:i + 3] for i in range(6, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    resp = e2e_spec.client().completions.create(
        model=e2e_spec.model, prompt=SHORT, max_tokens=40, temperature=0, stop=[stop],
        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.find(stop)]
    ids = list(choice.token_ids)
    assert ids == full[: len(ids)]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])


def test_request_override_and_its_limit(e2e_spec: E2E) -> None:
    import time

    time.sleep(1.5)  # the counters of earlier requests have come in
    before = e2e_spec.metric("vllm:spec_decode_num_draft_tokens_total")
    got = complete(e2e_spec, SHORT, 24, False, num_speculative_tokens=0)
    assert got == plain_engine_greedy(e2e_spec, SHORT, 24)
    time.sleep(1.5)
    assert e2e_spec.metric("vllm:spec_decode_num_draft_tokens_total") == before
    with pytest.raises(openai.BadRequestError, match="num_speculative_tokens=5 is above this "
                                                     "worker's limit of 3"):
        complete(e2e_spec, SHORT, 8, False, num_speculative_tokens=5)


def test_n_choices_and_logprobs_with_drafts(e2e_spec: E2E) -> None:
    """n = 2 greedy choices each draft on their own and both equal the plain answer; their
    logprobs (several tokens a step) equal those of the same request with drafts off
    (``num_speculative_tokens: 0``) on the same worker."""
    want = plain_engine_greedy(e2e_spec, SHORT, 32)

    def ask(**extra: object):
        return e2e_spec.client().completions.create(
            model=e2e_spec.model, prompt=SHORT, max_tokens=32, temperature=0, n=2, logprobs=2,
            extra_body={"return_token_ids": True, "ignore_eos": True, **extra})

    spec, plain = ask(), ask(num_speculative_tokens=0)
    assert len(spec.choices) == 2
    ref = plain.choices[0].logprobs
    for choice in spec.choices:
        assert list(choice.token_ids) == want
        lp = choice.logprobs
        assert lp.tokens == ref.tokens and len(lp.tokens) == len(want)
        assert lp.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-4)
        assert [sorted(t) for t in lp.top_logprobs] == [sorted(t) for t in ref.top_logprobs]
