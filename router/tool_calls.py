"""Tool calling at the router: which tool-call syntax a model writes (read from its chat template),
the request's tools and tool_choice checked, the grammar that enforces the syntax, and the
model's text parsed back into OpenAI ``tool_calls``.

Three syntaxes, named as xgrammar names their structural tags (the grammar the workers compile
for them, ``worker/grammar_cache.py``):
- ``qwen_3`` (Hermes / Qwen): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
- ``llama`` (Llama 3.x): ``{"name": ..., "parameters": {...}}``
- ``deepseek_v4`` (DSML): ``<｜DSML｜tool_calls>`` around ``<｜DSML｜invoke name="...">`` blocks of
  ``<｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>``
Which syntax a request uses: the ``--tool-call-parser`` setting (vLLM's names, ``PARSERS``), else
the one the chat template teaches its model. Named and ``required`` tool_choice need no parser:
without one the calls are written in the Hermes form, which the grammar enforces and which is
taught by a default tool prompt (``default_tool_prompt``) when the template does not render tools
itself. ``auto`` lets the model choose to call or not, so its syntax must be the model's own: with
no parser it is a 400 saying which settings enable it.
Torch-free; pure functions of text.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from router.errors import invalid_request
from router.schema_check import check_schema
from router.tool_call_deltas import CallDelta, IncrementalCalls, StreamedCall

log = logging.getLogger("bulkhead.router.tools")

TRIGGERS = {"qwen_3": "<tool_call>", "llama": '{"name": ', "deepseek_v4": "<｜DSML｜tool_calls>"}
# --tool-call-parser values (vLLM's spellings) -> the syntax they read
PARSERS = {"hermes": "qwen_3", "qwen3": "qwen_3", "llama3_json": "llama", "llama4_json": "llama",
           "deepseek_v4": "deepseek_v4"}
DEFAULT_FORMAT = "qwen_3"  # named / required calls on a model whose template names no syntax
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


def template_reads_tools(template_source: str | None) -> bool:
    """Whether a chat template renders the ``tools`` it is given (else they would vanish)."""
    if not template_source:
        return False
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(template_source))
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in names


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for this request."""

    tools: list[dict[str, Any]]  # as the template and the grammar take them
    format: str | None  # None: tool_choice "none", output is not parsed
    grammar_spec: str  # "" when nothing is enforced
    # the template does not render tools: the prompt gets default_tool_prompt(format) instead
    default_prompt: bool = False


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel_tool_calls: bool | None, template_source: str | None,
               parser: str = "") -> ToolPlan | None:
    """Check ``tools`` / ``tool_choice``; None when the request has no tools. ``parser``: the
    ``--tool-call-parser`` setting ('' = the template's own syntax). Raises ApiError naming
    the field."""
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
    fmt = PARSERS[parser] if parser else detect_format(template_source)
    if fmt is None:
        if choice == "auto":
            raise invalid_request(
                "tool_choice: \"auto\" needs a tool-call parser, and this model's chat template "
                "teaches no tool-call syntax this server knows (Hermes/Qwen <tool_call>, Llama "
                "3.x JSON, DeepSeek-V4 DSML). Start the server with --tool-call-parser "
                f"({', '.join(PARSERS)}) or --chat-template FILE (a template with tool-call "
                "syntax), or send tool_choice \"required\" or a named function, which work on "
                "any model", "tool_choice")
        fmt = DEFAULT_FORMAT
    spec = json.dumps({"format": fmt, "tools": tools, "tool_choice": choice,
                       "parallel_tool_calls": parallel_tool_calls is not False},
                      separators=(",", ":"))  # key order kept: arguments follow the schema
    return ToolPlan(tools, fmt, spec, default_prompt=not template_reads_tools(template_source))


def default_tool_prompt(fmt: str, tools: list[dict[str, Any]]) -> str:
    """The tools and the call syntax, for a chat template that does not render tools: the Hermes
    form (Qwen 2.5's own words), Llama 3.1's JSON form, or DeepSeek-V4's DSML, as the parser
    that will read the calls (and the grammar that enforces them) expects."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt == "deepseek_v4":
        return ("You have access to the following functions:\n" + listed + "\n\nTo call "
                "functions, write <｜DSML｜tool_calls> then, for each call, <｜DSML｜invoke "
                "name=\"NAME\"> with one <｜DSML｜parameter name=\"ARG\" string=\"true|false\">"
                "VALUE</｜DSML｜parameter> per argument (string=\"false\": VALUE is JSON) and "
                "</｜DSML｜invoke>, then </｜DSML｜tool_calls>.")
    if fmt == "llama":
        return ("You have access to the following functions. To call a function, respond with "
                "a JSON object of the form {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}.\n\n" + listed)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
            "</tool_call>")


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


def rest_of_calls(parsed: ParsedOutput, streamed: list[StreamedCall]) -> list[CallDelta]:
    """What the end of the answer adds to the calls already streamed: calls the incremental
    reader did not find in full, whole."""
    out: list[CallDelta] = []
    for k, call in enumerate(parsed.calls):
        sent = streamed[k] if k < len(streamed) else None
        if sent is None:
            out += [CallDelta(k, name=call.name), CallDelta(k, arguments=call.arguments)]
        elif sent.name == call.name and call.arguments.startswith(sent.arguments):
            if len(call.arguments) > len(sent.arguments):
                out.append(CallDelta(k, arguments=call.arguments[len(sent.arguments):]))
        else:  # an object with a repeated key (json.loads keeps the last value)
            log.warning("streamed tool call %d differs from the parsed one", k)
    return out


class ToolCallStream:
    """Streams one choice's text as content until a tool call may have begun; from there on the
    calls stream as they are generated (``take_deltas``: a call's name, then its arguments in
    fragments, router/tool_call_deltas.py), and the whole text is parsed at the end for what
    the incremental reader missed.

    One rule for every finish state, streamed or not (``answer_of`` runs this same reader over
    the whole text): the calls of the answer are the calls whose beginning was written. A call
    cut by max_tokens is a call whose arguments are the text written so far (not valid JSON),
    with finish_reason ``length``, as OpenAI answers a cut call; text after the first call's
    trigger is never content. Output with no call at all is content."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._trigger = TRIGGERS[fmt]
        self._text = ""
        self._sent = 0  # characters of _text already streamed as content
        self._holding = False  # a trigger was seen: nothing more streams as content
        self._trigger_at = -1
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
            self._trigger_at = at
            self._deltas += self.calls.feed(self._text[at:])
            return self._release(at)
        # keep back a tail that could be the start of the trigger
        end = len(self._text)
        for k in range(min(len(self._trigger) - 1, end - self._sent), 0, -1):
            if self._trigger.startswith(self._text[end - k:]):
                end -= k
                break
        return self._release(end)

    def _release(self, end: int) -> str:
        piece = self._text[self._sent:end]
        if not self._text[:end].strip():  # leading blanks wait: a call may follow them
            return ""
        if not self._text[:self._sent].strip():
            piece = self._text[:end]  # the blanks held so far go out with the first text
        self._sent = end
        return piece

    def finish(self) -> tuple[str, list[CallDelta], ParsedOutput]:
        """(content still to stream, call pieces still to stream, the whole answer)."""
        parsed = parse_tool_calls(self.fmt, self._text)
        streamed = self.calls.calls
        if not streamed and not parsed.calls:
            rest = self._text[self._sent:] if self._text[:self._sent].strip() else self._text
            self._sent = len(self._text)
            return rest, [], ParsedOutput(self._text, ())
        rest_deltas = rest_of_calls(parsed, streamed)
        calls: dict[int, list[str]] = {k: [c.name, c.arguments] for k, c in enumerate(streamed)}
        for d in rest_deltas:
            if d.name is not None:
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
        prefix = self._text[:self._trigger_at] if self._trigger_at >= 0 else ""
        return "", rest_deltas, ParsedOutput(
            prefix if prefix.strip() else None,
            tuple(ParsedToolCall(calls[k][0], calls[k][1]) for k in sorted(calls)))


def answer_of(fmt: str, text: str) -> ParsedOutput:
    """The non-streamed answer of ``text``: what its stream sends, read in one piece."""
    stream = ToolCallStream(fmt)
    stream.add(text)
    return stream.finish()[2]
