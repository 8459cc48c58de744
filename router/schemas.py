"""Pydantic models of the OpenAI request bodies: the HTTP edge, and the only place pydantic is used.

Range checks that do not depend on settings live here (pydantic reports the field); the
settings-dependent ones (n, number of stop strings, context length) live in the handler.
Unknown fields are ignored, as vLLM does.  This module must never import torch or reach a worker.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_MAX_SEED = 2**63 - 1
_MAX_INT32 = 2**31 - 1   # proto int32 fields (top_k, token ids)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = ConfigDict(extra="ignore")
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
    user: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Parsed only to refuse them clearly: this server has no tool-call or JSON-mode decoding.
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
