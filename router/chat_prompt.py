"""Chat messages -> prompt text through the model's own chat template, the way OpenAI and vLLM
read the request: ``developer`` is a system turn, assistant ``tool_calls`` and ``tool`` turns
(``tool_call_id``, ``name``) reach the template, ``chat_template_kwargs`` are template variables,
and ``continue_final_message`` leaves the last assistant turn open for the model to continue.

A template that does not render tools gets them another way when a call is asked for
(``tool_choice`` required or named, router/tool_calls.py): the default tool prompt joins the
first system message (or opens the chat as one), earlier assistant calls are written into their
turn's text in the same syntax, and tool results become user turns in ``<tool_response>`` tags,
as Qwen 2.5's template writes them.

Torch-free; never reaches a worker. Errors are ``ApiError``s naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import ApiError, invalid_request
from router.schemas import ChatCompletionRequest, ChatMessage
from router.tokenizer_port import RouterTokenizer
from router.tool_calls import default_tool_prompt

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


def _call_text(fmt: str, call: dict[str, Any]) -> str:
    fn = call["function"]
    if fmt == "llama":
        return json.dumps({"name": fn["name"], "parameters": fn["arguments"]}, ensure_ascii=False)
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def with_default_tools(messages: list[dict[str, Any]], fmt: str,
                       tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template that does not render tools (see the module's docstring)."""
    prompt = default_tool_prompt(fmt, tools)
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(_call_text(fmt, c) for c in m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{calls}" if m["content"] else calls
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(req: ChatCompletionRequest, tokenizer: RouterTokenizer,
                tools: list[dict[str, Any]] | None = None,
                default_tools_format: str | None = None) -> str:
    """The prompt text of ``req.messages``; with ``default_tools_format`` the ``tools`` reach
    the prompt through ``with_default_tools`` instead of the template."""
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
    if default_tools_format is not None and tools:
        messages, tools = with_default_tools(messages, default_tools_format, tools), None
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
