"""Pydantic models of the OpenAI request bodies: the HTTP edge, and the only place pydantic is used.

Range checks that do not depend on settings live here (pydantic reports the field); the
settings-dependent ones (n, number of stop strings, context length) live in the handler.
Unknown fields are ignored, as vLLM does.  Every model derives from `StrictModel`: a JSON
``"10"`` is not an int, ``true`` is not 1 and ``"yes"`` is not a bool, for fields added later
too.  Request bodies derive from `RequestBody`, which refuses text that is not valid Unicode (a
lone surrogate such as ``"\\ud800"`` decodes from JSON but cannot be encoded, tokenized or
logged) anywhere in the body, naming the field.  This module must never import torch or reach
a worker.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.refused_fields import RefusedChatFields, RefusedCompletionFields

_MAX_SEED = 2**63 - 1
_MAX_INT32 = 2**31 - 1   # proto int32 fields (top_k, token ids)


class InvalidText(ValueError):
    """A string in the body is not valid Unicode; `param` names where (``messages[0].content``)."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.param = param


class UnsupportedPart(ValueError):
    """A message's content part this server cannot take (an image, audio, a file): `where` is
    the part's place under the field that raised it (``[1].type``)."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(detail)
        self.where = where


def _bad_unicode(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return (f"invalid Unicode: lone surrogate \\u{code:04x} at character {exc.start} "
                "(not valid UTF-8 text)")
    return None


def find_invalid_text(body: Any) -> InvalidText | None:
    """The first string (value or key) in a decoded JSON body that is not valid Unicode.

    Iterative, so a deeply nested body cannot exhaust the stack here."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            problem = _bad_unicode(value)
            if problem:
                return InvalidText(path or "body", problem)
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                key_problem = _bad_unicode(key) if isinstance(key, str) else None
                if key_problem:
                    return InvalidText(path or "body", f"a key has {key_problem}")
                todo.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


class StrictModel(BaseModel):
    """No coercion: the JSON type must be the field's type (an int is still a valid float)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class RequestBody(StrictModel):
    """A whole request body: refuses invalid Unicode anywhere in it before fields are read."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        problem = find_invalid_text(data)
        if problem is not None:
            raise problem
        return data


class StreamOptions(StrictModel):
    include_usage: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Name the first part that is not text, rather than every union member's complaint."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise UnsupportedPart(f"[{i}].type", f"{kind!r} parts are not supported: "
                                          "this server's models take text parts only")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: one source of a grammar the output must follow."""

    # a JSON schema (object or its text); "json" in the body (the name shadows BaseModel.json)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                   # EBNF (GBNF), as xgrammar reads it
    json_object: bool | None = None
    structural_tag: str | None = None            # an xgrammar structural tag (JSON text)
    # vLLM's backend knobs: one backend here, and its JSON is always compact
    disable_fallback: bool | None = None         # not applicable: there is no fallback
    disable_any_whitespace: bool | None = None   # true is what this server does; false refused
    disable_additional_properties: bool | None = None  # refused when true
    whitespace_pattern: str | None = None        # refused


class _SamplingFields(RequestBody):
    """Fields shared by chat and completions."""

    model: str | None = None          # None: the served model (as vLLM)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=_MAX_INT32)] | None = None   # extension; -1/0 = off
    seed: Annotated[int, Field(ge=0, le=_MAX_SEED)] | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=_MAX_INT32)]] | None = None  # vLLM ext.
    ignore_eos: bool = False                                          # vLLM extension
    return_token_ids: bool = False                                    # vLLM extension
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # vLLM extension; below 0.01, 1/r leaves float32's range (engine/sampling_params.py)
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0                 # vLLM extension
    min_tokens: Annotated[int, Field(ge=0, le=_MAX_INT32)] = 0           # vLLM extension
    # speculative decoding: most draft tokens per step for this request (0: none; None: the
    # decode worker's num_speculative_tokens; above it: a 400 from the worker)
    num_speculative_tokens: Annotated[int, Field(ge=0, le=16)] | None = None  # extension
    user: str | None = None
    # vLLM's detokenization fields (router/text_stream.py TextOptions)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's structured outputs and their older names (router/structured_outputs.py)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_SamplingFields, RefusedChatFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # vLLM's chat template controls
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling (router/tool_calls.py) and structured outputs (router/job.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, RefusedCompletionFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 scores the prompt only (echo with logprobs, as lm-eval's loglikelihood sends)
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None   # OpenAI's limit
    echo: bool = False
    response_format: dict[str, Any] | None = None   # vLLM takes it on completions too
