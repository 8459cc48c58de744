"""A validated, tokenized generation request: what the dispatcher runs, with no HTTP left in it.

Built from the pydantic request bodies; checks the settings-dependent limits (n, stop strings,
number of prompts, token ids in range) and refuses unsupported features with a 400 that names
the field.  This module must never reach a worker and never import torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from common.token_bound import min_tokens
from router.chat_prompt import render_chat
from router.errors import (
    context_length_certainly_exceeded,
    invalid_request,
    model_not_found,
)
from router.refused_fields import refuse_unimplemented
from router.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from router.settings import RouterSettings
from router.structured_outputs import output_grammar
from router.text_stream import TextOptions
from router.tokenizer_port import RouterTokenizer
from router.tool_calls import plan_tools
from router.worker_codec import LogitShaping


@dataclass(frozen=True)
class GenerationJob:
    kind: Literal["chat", "completion"]
    model: str
    prompts: tuple[tuple[int, ...], ...]   # token ids of each prompt
    max_tokens: int | None                  # None: as many as the context allows (chat)
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    shaping: LogitShaping = LogitShaping()
    logprobs: int | None = None   # None: none; k: each token's logprob and the top k
    echo: bool = False            # completions: the prompt's text before the completion
    # completions echo with logprobs: each prompt token's logprob and top k (the first: null)
    prompt_logprobs: int | None = None
    grammar_kind: str = ""        # constrained decoding (worker/grammar_cache.py), "" = none
    grammar_spec: str = ""
    grammar_param: str = ""       # the request field the grammar came from, for its errors
    tool_format: str | None = None  # chat: parse the output as this tool-call syntax
    text: TextOptions = TextOptions()  # how tokens become text (skip_special_tokens, ...)
    num_speculative_tokens: int | None = None  # None: the decode worker's setting

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


def _common(req: _SamplingFields, settings: RouterSettings,
            vocab_size: int | None = None) -> dict[str, object]:
    """`vocab_size`: the tokenizer's, where known (token ids past it are refused here)."""
    if req.model is not None and req.model != settings.model_name:
        raise model_not_found(req.model, settings.model_name)
    if req.n > settings.max_n:
        raise invalid_request(f"n: {req.n} is more than the limit {settings.max_n}", "n")
    stop: tuple[str, ...]
    if req.stop is None:
        stop = ()
    elif isinstance(req.stop, str):
        stop = (req.stop,)
    else:
        stop = tuple(req.stop)
    if len(stop) > settings.max_stop_strings:
        raise invalid_request(f"stop: {len(stop)} strings, the limit is "
                              f"{settings.max_stop_strings}", "stop")
    if any(s == "" for s in stop):
        raise invalid_request("stop: empty stop strings are not allowed", "stop")
    refuse_unimplemented(req, req.n)
    if req.stream_options is not None and not req.stream:
        raise invalid_request("stream_options: only allowed when stream is true",
                              "stream_options")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return dict(
        model=settings.model_name,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k, seed=req.seed, n=req.n, stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        return_token_ids=req.return_token_ids,
        num_speculative_tokens=req.num_speculative_tokens,
        text=TextOptions(skip_special_tokens=req.skip_special_tokens,
                         spaces_between_special_tokens=req.spaces_between_special_tokens,
                         include_stop_str_in_output=req.include_stop_str_in_output),
        shaping=LogitShaping(
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, vocab_size),
            min_p=req.min_p, min_tokens=req.min_tokens))


def _token_end(vocab_size: int | None) -> int:
    """One past the largest token id a request may name: the tokenizer's vocabulary where known,
    else what the proto's int32 token ids hold."""
    return vocab_size if vocab_size is not None else 2**31


MAX_LOGIT_BIAS = 300   # the engine's per-slot buffer holds this many entries
_TOKEN_KEY = re.compile(r"-?[0-9]{1,19}")


def _logit_bias(given: dict[str, float] | None, vocab_size: int | None
                ) -> tuple[tuple[int, float], ...]:
    if not given:
        return ()
    if len(given) > MAX_LOGIT_BIAS:
        raise invalid_request(f"logit_bias: {len(given)} entries, the limit is {MAX_LOGIT_BIAS}",
                              "logit_bias")
    end = _token_end(vocab_size)
    out = []
    for key, bias in given.items():
        # ASCII digits only: int() also reads "٣", " 3", "+3" and "1_0" as numbers
        if not _TOKEN_KEY.fullmatch(key):
            raise invalid_request(f"logit_bias: key {key!r} is not a token id (ASCII digits)",
                                  "logit_bias")
        token = int(key)
        if not 0 <= token < end:
            raise invalid_request(f"logit_bias: token id {token} is outside [0, {end})",
                                  "logit_bias")
        out.append((token, float(bias)))
    return tuple(sorted(dict(out).items()))  # "1" and "01" name one token: the last wins


def _check_min_tokens(count: int, max_tokens: int | None, max_context: int | None) -> None:
    """min_tokens may not pass max_tokens, nor (max_tokens unset) the longest context."""
    if max_tokens is not None and count > max_tokens:
        raise invalid_request(f"min_tokens: {count} is more than max_tokens {max_tokens}",
                              "min_tokens")
    if max_context is not None and count > max_context:
        raise invalid_request(f"min_tokens: {count} is more than the longest context "
                              f"({max_context} tokens)", "min_tokens")


def _refuse_if_certainly_over(text: str, tokenizer: RouterTokenizer, num_new: int | None,
                              max_context: int | None, param: str) -> None:
    """Refuse a text whose length alone proves it over the context, before tokenizing it."""
    if max_context is None:
        return
    at_least = min_tokens(text, getattr(tokenizer, "max_token_bytes", None))
    new = num_new if num_new is not None else 1
    if at_least + new > max_context:
        raise context_length_certainly_exceeded(at_least, new, max_context, param)


def chat_job(req: ChatCompletionRequest, settings: RouterSettings,
             tokenizer: RouterTokenizer, max_context: int | None = None) -> GenerationJob:
    """`max_context`: the largest context a worker serves, for the pre-tokenization bound."""
    common = _common(req, settings, getattr(tokenizer, "vocab_size", None))
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs: set logprobs to true to use it", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                       getattr(tokenizer, "chat_template_source", None),
                       settings.tool_call_parser)
    grammar = output_grammar(req, req.response_format)
    grammar_kind, grammar_spec, grammar_param = grammar.kind, grammar.spec, grammar.param
    if tools is not None and tools.grammar_spec:
        if grammar_kind:
            raise invalid_request(f"{grammar.param}: not together with tools (a tool call is "
                                  "already constrained); send one", grammar.param)
        grammar_kind, grammar_spec, grammar_param = "tool_calls", tools.grammar_spec, "tools"
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise invalid_request("max_tokens and max_completion_tokens disagree; send one",
                              "max_completion_tokens")
    text = render_chat(req, tokenizer, tools.tools if tools is not None else None,
                       tools.format if tools is not None and tools.default_prompt else None)
    max_tokens = req.max_completion_tokens or req.max_tokens
    _refuse_if_certainly_over(text, tokenizer, max_tokens, max_context, "messages")
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise invalid_request("messages: they render to an empty prompt", "messages")
    _check_min_tokens(req.min_tokens, max_tokens, max_context)
    return GenerationJob(kind="chat", prompts=(ids,), max_tokens=max_tokens,  # type: ignore[arg-type]
                         logprobs=logprobs, grammar_kind=grammar_kind, grammar_spec=grammar_spec,
                         grammar_param=grammar_param, tool_format=tools.format if tools is not None else None, **common)


def _check_ids(ids: Sequence[int], vocab_size: int | None, param: str) -> tuple[int, ...]:
    if not ids:
        raise invalid_request(f"{param}: empty prompt", param)
    end = _token_end(vocab_size)
    for tid in ids:
        if not 0 <= tid < end:
            raise invalid_request(f"{param}: token id {tid} is outside [0, {end})", param)
    return tuple(ids)


def completion_job(req: CompletionRequest, settings: RouterSettings,
                   tokenizer: RouterTokenizer, max_context: int | None = None) -> GenerationJob:
    common = _common(req, settings, getattr(tokenizer, "vocab_size", None))
    if req.max_tokens == 0 and not (req.echo and req.logprobs is not None):
        raise invalid_request("max_tokens: 0 is only allowed with echo and logprobs (scoring the "
                              "prompt); otherwise it must be >= 1", "max_tokens")
    vocab_size = getattr(tokenizer, "vocab_size", None)
    p = req.prompt
    raw: list[str | list[int]]
    if isinstance(p, str):
        raw = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [list(p)]  # type: ignore[arg-type]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if not raw:
        raise invalid_request("prompt: empty list", "prompt")
    if len(raw) > settings.max_prompts:
        raise invalid_request(f"prompt: {len(raw)} prompts, the limit is {settings.max_prompts}",
                              "prompt")
    if len(raw) * req.n > settings.max_prompts:
        raise invalid_request(f"n: {len(raw)} prompts x n={req.n} is more than "
                              f"{settings.max_prompts} choices", "n")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    prompts = []
    for i, item in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            _refuse_if_certainly_over(item, tokenizer, max_tokens, max_context, param)
            ids = tokenizer.encode(item, add_special_tokens=True)
            prompts.append(_check_ids(ids, None, param))
        else:
            prompts.append(_check_ids(item, vocab_size, param))
    _check_min_tokens(req.min_tokens, max_tokens, max_context)
    grammar = output_grammar(req, req.response_format)
    return GenerationJob(kind="completion", grammar_kind=grammar.kind, grammar_spec=grammar.spec,
                         grammar_param=grammar.param, prompts=tuple(prompts), max_tokens=max_tokens,
                         logprobs=req.logprobs, echo=req.echo,
                         prompt_logprobs=req.logprobs if req.echo else None,
                         **common)  # type: ignore[arg-type]
