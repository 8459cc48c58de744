"""Completions ``echo`` with ``logprobs`` (prompt logprobs) through router + prefill + decode
processes with the official openai client, on both routes, against transformers' log-softmax of
one full forward of the same fp32 checkpoint; max_tokens 0 (what lm-eval's loglikelihood sends);
a prompt whose prefix is cached is still scored; streamed equals non-streamed."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import E2E, SPLIT_THRESHOLD

SHORT = [(11 * i) % 290 + 5 for i in range(13)]  # decode route
LONG = [(5 * i + 3) % 290 + 5 for i in range(SPLIT_THRESHOLD + 11)]  # split route


@pytest.fixture(scope="module")
def hf_model(e2e: E2E):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(e2e.folder, dtype=torch.float32).eval()


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row j scores prompt token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def check_prompt_logprobs(model, prompt: list[int], lp, k: int) -> None:
    ref = reference(model, prompt)
    n = len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) >= n and len(lp.token_logprobs) >= n
    got = torch.tensor(lp.token_logprobs[1:n])
    want = ref[torch.arange(n - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    for j in range(1, n):
        top = lp.top_logprobs[j]
        # keyed by text: byte pieces may decode alike, so at most k entries, and the best is
        # the reference's best
        assert 0 < len(top) <= k
        assert max(top.values()) == pytest.approx(float(ref[j - 1].max()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode", "split"])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_logprobs_equal_transformers(e2e: E2E, hf_model, prompt: list[int],
                                          max_tokens: int) -> None:
    client = e2e.client()
    r = client.completions.create(model=e2e.model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, echo=True, logprobs=3,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    check_prompt_logprobs(hf_model, prompt, choice.logprobs, 3)
    assert len(choice.logprobs.tokens) == len(prompt) + max_tokens
    assert r.usage.completion_tokens == max_tokens
    assert choice.finish_reason == "length"
    from common.tokenizer import Tokenizer

    prompt_text = Tokenizer.from_path(e2e.folder).decode(prompt)
    assert choice.text.startswith(prompt_text)
    if max_tokens:
        plain = client.completions.create(model=e2e.model, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, logprobs=3,
                                          extra_body={"ignore_eos": True})
        assert choice.text == prompt_text + plain.choices[0].text
        # the generated tokens' logprobs follow the prompt's, as they are without echo
        assert choice.logprobs.token_logprobs[len(prompt):] == pytest.approx(
            plain.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_a_cached_prefix_is_scored_anyway(e2e: E2E, hf_model) -> None:
    client = e2e.client()
    prompt = [(3 * i + 1) % 290 + 5 for i in range(SPLIT_THRESHOLD + 20)]
    for _ in range(2):  # the second plain request reuses the first's KV
        plain = client.completions.create(model=e2e.model, prompt=prompt, max_tokens=1,
                                          temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0
    r = client.completions.create(model=e2e.model, prompt=prompt, max_tokens=0, temperature=0,
                                  echo=True, logprobs=1)
    check_prompt_logprobs(hf_model, prompt, r.choices[0].logprobs, 1)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode", "split"])
def test_streamed_echo_logprobs_equal_the_whole_answer(e2e: E2E, prompt: list[int]) -> None:
    client = e2e.client()
    kw = dict(model=e2e.model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
              logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    text, tokens, values = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:],
                                                            abs=1e-6)
