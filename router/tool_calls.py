"""Tool calling at the router: which tool-call syntax a model writes (read from its chat template),
the request's tools and tool_choice checked, the grammar that enforces the syntax, and the
model's text parsed back into OpenAI ``tool_calls``.

Three syntaxes, named as xgrammar names their structural tags (the grammar the workers compile
for them, ``worker/grammar_cache.py``):
- ``qwen_3`` (Hermes / Qwen): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
- ``llama`` (Llama 3.x): ``{"name": ..., "parameters": {...}}``
- ``deepseek_v4`` (DSML): ``<｜DSML｜tool_calls>`` around ``<｜DSML｜invoke name="...">`` blocks of
  ``<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>``
Torch-free; pure functions of text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from router.errors import invalid_request
from router.schema_check import check_schema
from router.tool_call_deltas import CallDelta, IncrementalCalls

TRIGGERS = {"qwen_3": "<tool_call>", "llama": '{"name": ', "deepseek_v4": "<｜DSML｜tool_calls>"}
# fullmatch, not "$": "$" also matches before a trailing newline
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def detect_format(template_source: str | None) -> str | None:
    """The tool-call syntax a chat template teaches its model, or None."""
    if not template_source:
        return None
    if "DSML" in template_source:
        return "deepseek_v4"
    if "<tool_call>" in template_source:
        return "qwen_3"
    if "<|python_tag|>" in template_source or (
            "<|start_header_id|>" in template_source and "tools" in template_source):
        return "llama"
    return None


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for this request."""

    tools: list[dict[str, Any]]  # as the template and the grammar take them
    format: str | None  # None: tool_choice "none", output is not parsed
    grammar_spec: str  # "" when nothing is enforced


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None, template_source: str | None) -> ToolPlan | None:
    """Check ``tools`` / ``tool_choice``; None when the request has no tools. Raises ApiError
    naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid_request("tool_choice: set tools to choose one", "tool_choice")
        return None
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(fn, dict):
            raise invalid_request(f"tools[{i}]: only {{\"type\": \"function\", \"function\": "
                                  "{...}} tools are supported", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid_request(f"tools[{i}].function.name: must be 1-64 letters, digits, "
                                  "'_', '.' or '-'", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid_request(f"tools[{i}].function.parameters: must be a JSON schema "
                                  "object", f"tools[{i}].function.parameters")
        check_schema(params, f"tools[{i}].function.parameters")
        names.append(name)
    if len(set(names)) != len(names):
        raise invalid_request("tools: function names must be unique", "tools")
    choice: str | dict[str, Any] = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid_request(f"tool_choice: {choice!r} is not none, auto, required or "
                                  "a named function", "tool_choice")
    else:
        named = choice.get("function", {}).get("name") if isinstance(
            choice.get("function"), dict) else None
        if choice.get("type") != "function" or named not in names:
            raise invalid_request(f"tool_choice: {named!r} is not one of the tools "
                                  f"({', '.join(names)})", "tool_choice")
    if choice == "none":
        return ToolPlan(tools, None, "")
    fmt = detect_format(template_source)
    if fmt is None:
        raise invalid_request("tools: this model's chat template has no tool-call syntax this "
                              "server knows (Hermes/Qwen <tool_call>, Llama 3.x JSON, "
                              "DeepSeek-V4 DSML)", "tools")
    spec = json.dumps({"format": fmt, "tools": tools, "tool_choice": choice,
                       "parallel_tool_calls": parallel_tool_calls is not False},
                      separators=(",", ":"), sort_keys=True)
    return ToolPlan(tools, fmt, spec)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # text before the first call (None when only blanks)
    calls: tuple[ParsedToolCall, ...]


def parse_tool_calls(fmt: str, text: str) -> ParsedOutput:
    """Split a model's output into content and tool calls; text that does not parse as the
    format's calls stays content."""
    start = text.find(TRIGGERS[fmt])
    if start < 0:
        return ParsedOutput(text, ())
    body = text[start:]
    calls = {"qwen_3": _parse_hermes, "llama": _parse_llama, "deepseek_v4": _parse_dsml}[fmt](body)
    if not calls:
        return ParsedOutput(text, ())
    prefix = text[:start]
    return ParsedOutput(prefix if prefix.strip() else None, tuple(calls))


def _call(name: Any, args: Any) -> ParsedToolCall | None:
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


def _parse_hermes(body: str) -> list[ParsedToolCall]:
    out = []
    for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", body, re.DOTALL):
        try:
            obj = json.loads(m.group(1), strict=False)
        except json.JSONDecodeError:
            return []
        call = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
        if call is None:
            return []
        out.append(call)
    return out


def _parse_llama(body: str) -> list[ParsedToolCall]:
    out = []
    decoder = json.JSONDecoder(strict=False)  # control characters inside strings pass
    at = 0
    while at < len(body):
        while at < len(body) and body[at] in " \n\t;":
            at += 1
        if at >= len(body):
            break
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments", {}))) \
            if isinstance(obj, dict) else None
        if call is None:
            return []
        out.append(call)
    return out


_DSML_INVOKE = re.compile(r"<｜DSML｜invoke name=\"([^\"]+)\">(.*?)</｜DSML｜invoke>", re.DOTALL)
_DSML_PARAM = re.compile(
    r"<｜DSML｜parameter name=\"([^\"]+)\" string=\"(true|false)\">(.*?)</｜DSML｜parameter>",
    re.DOTALL)


def _parse_dsml(body: str) -> list[ParsedToolCall]:
    out = []
    for m in _DSML_INVOKE.finditer(body):
        args: dict[str, Any] = {}
        for p in _DSML_PARAM.finditer(m.group(2)):
            if p.group(2) == "true":
                args[p.group(1)] = p.group(3)
            else:
                try:
                    args[p.group(1)] = json.loads(p.group(3), strict=False)
                except json.JSONDecodeError:
                    return []
        call = _call(m.group(1), args)
        if call is None:
            return []
        out.append(call)
    return out


class ToolCallStream:
    """Streams one choice's text as content until a tool call may have begun; from there on the
    calls stream as they are generated (``take_deltas``: a call's name, then its arguments in
    fragments, router/tool_call_deltas.py), and the whole text is parsed at the end: the
    streamed calls are exactly the non-streamed ones. A call the output never completes (cut
    by max_tokens) has streamed its beginning; the end's parse then finds no calls and the text
    is content, as in the non-streamed answer."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._trigger = TRIGGERS[fmt]
        self._text = ""
        self._sent = 0  # characters of _text already streamed as content
        self._holding = False  # a trigger was seen: nothing more streams as content
        self.calls = IncrementalCalls(fmt)
        self._deltas: list[CallDelta] = []

    def take_deltas(self) -> list[CallDelta]:
        """The call pieces found since the last call of this."""
        out, self._deltas = self._deltas, []
        return out

    def add(self, text: str) -> str:
        """New text in; the content that may be streamed now out."""
        self._text += text
        if self._holding:
            self._deltas += self.calls.feed(text)
            return ""
        at = self._text.find(self._trigger, self._sent)
        if at >= 0:
            self._holding = True
            self._deltas += self.calls.feed(self._text[at:])
            return self._release(at)
        # keep back a tail that could be the start of the trigger
        end = len(self._text)
        for k in range(min(len(self._trigger) - 1, end - self._sent), 0, -1):
            if self._trigger.startswith(self._text[end - k:]):
                end -= k
                break
        return self._release(end)

    def _release(self, end: str | int) -> str:
        piece = self._text[self._sent:int(end)]
        if not self._text[:int(end)].strip():  # leading blanks wait: a call may follow them
            return ""
        if not self._text[:self._sent].strip():
            piece = self._text[:int(end)]  # the blanks held so far go out with the first text
        self._sent = int(end)
        return piece

    def finish(self) -> tuple[str, ParsedOutput]:
        """(content still to stream, the parse of the whole text)."""
        parsed = parse_tool_calls(self.fmt, self._text)
        if parsed.calls:
            return "", parsed
        rest = self._text[self._sent:] if self._text[:self._sent].strip() else self._text
        self._sent = len(self._text)
        return rest, parsed
