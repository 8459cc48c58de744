"""Request fields of the OpenAI and vLLM APIs that this server does not implement.

Each is parsed (as anything) only so that a request setting it is refused with a 400 naming the
field, instead of being accepted and silently ignored. A field leaves this list when it is
implemented. Torch-free; never reaches a worker.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from router.errors import ApiError

# field -> what it would do, for the error message
_CHAT_AND_COMPLETION = {
    "best_of": "server-side best-of sampling",
    "suffix": "insertion (suffix)",
    "use_beam_search": "beam search",
    "length_penalty": "beam-search length penalty",
    "prompt_logprobs": "prompt logprobs (use echo with logprobs on /v1/completions)",
    "truncate_prompt_tokens": "prompt truncation",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "priority": "request priorities",
    "logits_processors": "custom logits processors",
}
_CHAT_ONLY = {
    "functions": "the legacy functions API (use tools)",
    "function_call": "the legacy function_call API (use tool_choice)",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning effort",
    "web_search_options": "web search",
    "documents": "documents for retrieval templates",
    "mm_processor_kwargs": "multimodal processing",
}


class RefusedCompletionFields(BaseModel):
    """Mixed into the completion request: the fields refused on /v1/completions."""

    best_of: Any = None
    suffix: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    priority: Any = None
    logits_processors: Any = None


class RefusedChatFields(RefusedCompletionFields):
    """Mixed into the chat request: the fields refused on /v1/chat/completions."""

    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None


def _is_default(name: str, value: Any, n: int) -> bool:
    """Values that ask for nothing: None, empty, False; best_of equal to n; modalities text."""
    if value is None or value is False or value in ([], {}, ""):
        return True
    if name == "best_of":
        return value == n
    if name == "modalities":
        return value == ["text"]
    return False


def refuse_unimplemented(req: BaseModel, n: int = 1) -> None:
    """400 naming the first unimplemented field ``req`` sets to something that would matter."""
    table = {**_CHAT_AND_COMPLETION, **_CHAT_ONLY}
    for name in type(req).model_fields:
        if name in table and not _is_default(name, getattr(req, name), n):
            raise ApiError(400, f"{name}: {table[name]} is not supported by this server.",
                           "invalid_request_error", name, "unsupported_parameter")
