"""Chat messages -> prompt text through the model's own chat template, the way OpenAI and vLLM
read the request: ``developer`` is a system turn, assistant ``tool_calls`` and ``tool`` turns
(``tool_call_id``, ``name``) reach the template, ``chat_template_kwargs`` are template variables,
and ``continue_final_message`` leaves the last assistant turn open for the model to continue.

Torch-free; never reaches a worker. Errors are ``ApiError``s naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import ApiError, invalid_request
from router.schemas import ChatCompletionRequest, ChatMessage
from router.tokenizer_port import RouterTokenizer

# variables the renderer sets itself; a client may not override them through kwargs
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """One OpenAI message as the dict HF chat templates read."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = c.function.arguments  # templates that print it as text still can
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def render_chat(req: ChatCompletionRequest, tokenizer: RouterTokenizer,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text of ``req.messages``."""
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid_request("continue_final_message: set add_generation_prompt to false to "
                              "continue the final message", "continue_final_message")
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise invalid_request("continue_final_message: the last message must be an assistant "
                              "message", "continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(_RESERVED & kwargs.keys())
    if clash:
        raise invalid_request(f"chat_template_kwargs: {clash[0]} is set by the server",
                              "chat_template_kwargs")
    messages = [message_dict(m) for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=
                                             req.add_generation_prompt, tools=tools, **kwargs)
    except ApiError:
        raise
    except Exception as exc:  # a template may raise on an order of roles it does not accept
        raise invalid_request(f"messages: the chat template refused them: {exc}",
                              "messages") from None
    if req.continue_final_message:
        text = _open_final_message(text, messages[-1]["content"])
    return text


def _open_final_message(text: str, final: str) -> str:
    """Cut the rendered prompt right after the final message's content (as transformers does),
    dropping the end-of-turn tokens the template put after it."""
    final = final.strip()
    if not final:
        raise invalid_request("continue_final_message: the final assistant message is empty",
                              "continue_final_message")
    at = text.rfind(final)
    if at < 0:
        raise invalid_request("continue_final_message: the chat template does not render the "
                              "final message's content verbatim", "continue_final_message")
    return text[: at + len(final)]
