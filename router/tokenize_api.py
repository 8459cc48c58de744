"""The small endpoints clients probe before they send work: ``/tokenize`` and ``/detokenize``
(vLLM's shapes), ``/version``, and one model's card (``/v1/models/{id}``).

Request bodies are pydantic models (the HTTP edge); answers are plain dicts, written as JSON by
``json_body``. Tokenizing a chat renders it exactly as a chat completion would
(``router.chat_prompt``), so a client can count a conversation's tokens before sending it.
Torch-free; never reaches a worker. The app runs these off the event loop (a thread); what
runs there leaves the GIL to the loop at least every few milliseconds: the tokenizer's batch
calls release it, and ``json_body`` writes a long list or text in slices.
"""

from __future__ import annotations

import json
from importlib import metadata
from typing import Annotated, Any

from pydantic import Field

from router.chat_prompt import render_chat
from router.errors import invalid_request, model_not_found
from router.schemas import ChatCompletionRequest, ChatMessage, RequestBody
from router.tokenizer_port import RouterTokenizer

_MAX_INT32 = 2**31 - 1
# items of a list, characters of a text, written by one json.dumps call (each holds the GIL:
# one call over 1M token ids held it 0.14 s; a slice of 65,536 takes ~9 ms)
JSON_SLICE = 65_536


class TokenizeRequest(RequestBody):
    """Either ``prompt`` (text) or ``messages`` (a chat, rendered by the model's template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt only: a chat's template places its own
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False  # each token's vocabulary entry too, as vLLM answers


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=_MAX_INT32)]]


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise model_not_found(name, served)


def tokenize(req: TokenizeRequest, tokenizer: RouterTokenizer, max_model_len: int | None
             ) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request("send exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise invalid_request("messages: at least one message", "messages")
        chat = ChatCompletionRequest(
            messages=req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs)
        ids = tokenizer.encode(render_chat(chat, tokenizer, req.tools), add_special_tokens=False)
    else:
        ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": token_strings(tokenizer, ids) if req.return_token_strs else None}


def token_strings(tokenizer: RouterTokenizer, ids: list[int]) -> list[str]:
    """The vocabulary entry of each id (byte-level BPE shows a space as "Ġ"), as
    ``convert_ids_to_tokens`` gives; a tokenizer without a vocabulary view decodes each id."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "id_to_token"):
        return [backend.id_to_token(i) or "" for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def detokenize(req: DetokenizeRequest, tokenizer: RouterTokenizer) -> dict[str, Any]:
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None:
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise invalid_request(f"tokens: token id {bad} is outside [0, {vocab})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def version() -> dict[str, str]:
    try:
        v = metadata.version("bulkhead-serve")
    except metadata.PackageNotFoundError:
        v = "unknown"
    return {"version": v}


def model_card(model_id: str, served: str, max_model_len: int | None) -> dict[str, Any]:
    if model_id != served:
        raise model_not_found(model_id, served)
    card: dict[str, Any] = {"id": served, "object": "model", "created": 0,
                            "owned_by": "bulkhead"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_body(answer: dict[str, Any]) -> bytes:
    """``answer`` as compact UTF-8 JSON, the bytes Starlette's JSONResponse writes, with long
    lists and texts written a slice at a time so that no single call holds the GIL for long."""
    parts = []
    for key, value in answer.items():
        if isinstance(value, list) and len(value) > JSON_SLICE:
            text = "[" + ",".join(_dumps(value[i:i + JSON_SLICE])[1:-1]
                                  for i in range(0, len(value), JSON_SLICE)) + "]"
        elif isinstance(value, str) and len(value) > JSON_SLICE * 16:
            step = JSON_SLICE * 16
            text = '"' + "".join(_dumps(value[i:i + step])[1:-1]
                                 for i in range(0, len(value), step)) + '"'
        else:
            text = _dumps(value)
        parts.append(f"{_dumps(key)}:{text}")
    return ("{" + ",".join(parts) + "}").encode("utf-8")
