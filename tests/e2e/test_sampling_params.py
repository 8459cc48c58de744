"""Every sampling parameter through router + prefill + decode processes with the official openai
client: each test fails if the parameter were accepted and ignored. Logprobs of greedy steps
equal transformers' log-softmax on the same checkpoint (fp32), on both routes."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from tests.e2e.conftest import E2E, SPLIT_THRESHOLD

SHORT = [(13 * i) % 300 + 4 for i in range(12)]  # decode route
LONG = [(7 * i + 5) % 300 + 4 for i in range(SPLIT_THRESHOLD + 9)]  # split route


def ids_of(e2e: E2E, prompt: list[int], max_tokens: int = 8, **kw) -> list[int]:
    r = e2e.client().completions.create(
        model=e2e.model, prompt=prompt, max_tokens=max_tokens, temperature=kw.pop("temperature", 0),
        extra_body={"return_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})}, **kw)
    return list(r.choices[0].token_ids)


@pytest.fixture(scope="module")
def hf_model(e2e: E2E):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(e2e.folder, dtype=torch.float32).eval()


def hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode", "split"])
def test_logit_bias_moves_the_greedy_token(e2e: E2E, prompt: list[int]) -> None:
    plain = ids_of(e2e, prompt, 3)
    banned = ids_of(e2e, prompt, 3, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    forced = ids_of(e2e, prompt, 3, logit_bias={"77": 100})
    assert forced == [77, 77, 77]


@pytest.mark.parametrize("param,value", [
    ("presence_penalty", 2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 3.0)])
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode", "split"])
def test_penalties_change_the_output(e2e: E2E, prompt: list[int], param: str,
                                     value: float) -> None:
    plain = ids_of(e2e, prompt, 24)
    kw = {param: value} if param != "repetition_penalty" else {"extra": {param: value}}
    penalised = ids_of(e2e, prompt, 24, **kw)
    assert penalised != plain
    assert ids_of(e2e, prompt, 24, **kw) == penalised  # deterministic, not noise
    if param != "repetition_penalty":  # output-only penalties: repeats get rarer
        assert len(set(penalised)) >= len(set(plain))


def test_min_tokens_holds_eos_back(e2e: E2E) -> None:
    tok = json.loads((e2e.folder / "tokenizer.json").read_text())["model"]["vocab"]["<|im_end|>"]
    client = e2e.client()
    bias = {str(tok): 100}
    r = client.completions.create(model=e2e.model, prompt=SHORT, max_tokens=10, temperature=0,
                                  logit_bias=bias, extra_body={"return_token_ids": True})
    assert list(r.choices[0].token_ids) == [tok] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=e2e.model, prompt=SHORT, max_tokens=10, temperature=0,
                                  logit_bias=bias,
                                  extra_body={"return_token_ids": True, "min_tokens": 4})
    got = list(r.choices[0].token_ids)
    assert len(got) == 5 and tok not in got[:4] and got[4] == tok


def test_min_p_one_is_greedy_at_any_temperature(e2e: E2E) -> None:
    plain = ids_of(e2e, SHORT, 16)
    hot = ids_of(e2e, SHORT, 16, temperature=2.0, seed=5)
    assert hot != plain
    assert ids_of(e2e, SHORT, 16, temperature=2.0, seed=5, extra={"min_p": 1.0}) == plain


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode", "split"])
def test_completion_logprobs_equal_transformers(e2e: E2E, hf_model, prompt: list[int]) -> None:
    r = e2e.client().completions.create(model=e2e.model, prompt=prompt, max_tokens=4,
                                        temperature=0, logprobs=5,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    ids = list(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == 4 == len(choice.token_ids)
    for step, token in enumerate(choice.token_ids):
        ref = hf_log_softmax(hf_model, ids)
        assert token == int(ref.argmax())
        assert abs(lp.token_logprobs[step] - float(ref[token])) < 1e-4
        top = torch.topk(ref, 5)
        got = lp.top_logprobs[step]  # keyed by text: byte tokens decoding alike share a key
        assert 1 <= len(got) <= 5 and max(got.values()) == pytest.approx(float(top.values[0]),
                                                                          abs=1e-4)
        for v in got.values():
            assert min(abs(v - t) for t in top.values.tolist()) < 1e-4
        ids.append(token)
    assert len(lp.tokens) == 4  # (byte pieces of one character decode alone as U+FFFD)
    assert lp.text_offset[0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_equal_transformers(e2e: E2E, hf_model, stream: bool) -> None:
    client = e2e.client()
    kw = dict(model=e2e.model, messages=[{"role": "user", "content": "What is the capital?"}],
              max_tokens=3, temperature=0, logprobs=True, top_logprobs=4,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    if stream:
        content, prompt_ids = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            prompt_ids = getattr(chunk, "prompt_token_ids", None) or prompt_ids
            for c in chunk.choices:
                if c.logprobs is not None:
                    content += c.logprobs.content
    else:
        r = client.chat.completions.create(**kw)
        content, prompt_ids = r.choices[0].logprobs.content, r.prompt_token_ids
    assert len(content) == 3 and prompt_ids
    ids = list(prompt_ids)
    for item in content:
        ref = hf_log_softmax(hf_model, ids)
        token = int(ref.argmax())
        assert abs(item.logprob - float(ref[token])) < 1e-4
        top = torch.topk(ref, 4)
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top.values.tolist(),
                                                                      abs=1e-4)
        assert item.top_logprobs[0].token == item.token
        assert item.bytes == list(item.token.encode())
        ids.append(token)


def test_echo_prepends_the_prompt(e2e: E2E) -> None:
    client = e2e.client()
    r = client.completions.create(model=e2e.model, prompt="Hello world", max_tokens=4,
                                  temperature=0, echo=True)
    plain = client.completions.create(model=e2e.model, prompt="Hello world", max_tokens=4,
                                      temperature=0)
    assert r.choices[0].text == "Hello world" + plain.choices[0].text


def prompt_ids(e2e: E2E, messages: list[dict], **extra) -> list[int]:
    r = e2e.client().chat.completions.create(
        model=e2e.model, messages=messages, max_tokens=1, temperature=0,
        extra_body={"return_token_ids": True, **extra})
    return list(r.prompt_token_ids)


def test_chat_template_controls(e2e: E2E) -> None:
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_path(e2e.folder)
    user = {"role": "user", "content": "Tell me a story"}
    # developer is a system turn
    assert prompt_ids(e2e, [{"role": "developer", "content": "Be brief"}, user]) == \
        prompt_ids(e2e, [{"role": "system", "content": "Be brief"}, user])
    # add_generation_prompt=false: no assistant header at the end
    with_header = tok.decode(prompt_ids(e2e, [user]), skip_special_tokens=False)
    without = tok.decode(prompt_ids(e2e, [user], add_generation_prompt=False),
                         skip_special_tokens=False)
    assert with_header.endswith("<|im_start|>assistant\n") and without.endswith("<|im_end|>\n")
    # continue_final_message: the assistant turn stays open after its content
    partial = [user, {"role": "assistant", "content": "Once upon a"}]
    text = tok.decode(prompt_ids(e2e, partial, add_generation_prompt=False,
                                 continue_final_message=True), skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nOnce upon a")
    # chat_template_kwargs reach the template (this template ignores them; a clash is refused)
    with pytest.raises(openai.BadRequestError) as exc:
        prompt_ids(e2e, [user], chat_template_kwargs={"add_generation_prompt": False})
    assert exc.value.body["param"] == "chat_template_kwargs"


def test_unimplemented_fields_are_refused(e2e: E2E) -> None:
    client = e2e.client()
    for extra in ({"best_of": 3}, {"bad_words": ["x"]}, {"suffix": "x"}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=e2e.model, prompt="Hi", max_tokens=2,
                                      extra_body=extra)
        assert exc.value.body["param"] == next(iter(extra))
