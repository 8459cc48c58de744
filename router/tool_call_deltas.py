"""Tool calls as they are generated: the text after a tool-call trigger in, OpenAI's incremental
pieces out (a call's name as soon as it is complete, then its arguments fragment by fragment).

The non-streamed answer's arguments are ``json.dumps(arguments, ensure_ascii=False)`` of the
parsed object (router/tool_calls.py). The fragments here are that same text, built token by
token: each complete JSON token is written as ``json.dumps`` writes it (strings re-escaped,
numbers re-printed, ``": "`` and ``", "`` separators, blanks dropped), so the fragments of a call
concatenate to exactly the non-streamed arguments (an object with a repeated key is the one
exception: ``json.loads`` keeps only its last value). DeepSeek-V4's DSML calls stream one
parameter at a time. Pure functions of text; never awaits, never imports torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_JSON_STRING = r'"(?:[^"\\]|\\.)*"'
_HEADERS = {
    # xgrammar's structural tags write exactly these openings (begin='<tool_call>\n{"name": ...')
    "qwen_3": re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*(' + _JSON_STRING
                         + r')\s*,\s*"arguments"\s*:\s*', re.DOTALL),
    "llama": re.compile(r'\{\s*"name"\s*:\s*(' + _JSON_STRING
                        + r')\s*,\s*"(?:parameters|arguments)"\s*:\s*', re.DOTALL),
    "deepseek_v4": re.compile(r'<｜DSML｜invoke name="([^"]+)">'),
}
_TRIGGER = {"qwen_3": "<tool_call>", "llama": '{"name"', "deepseek_v4": "<｜DSML｜invoke name="}
_DSML_PARAM = re.compile(
    r'\s*<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>',
    re.DOTALL)
_DSML_END = re.compile(r"\s*</｜DSML｜invoke>")
_SCALAR = set("0123456789+-.eEtrufalsnNIiy")


class JsonCanonicalizer:
    """Reads one JSON value character by character; writes each token once it is complete, as
    ``json.dumps(..., ensure_ascii=False)`` would. ``done`` once the value is closed."""

    def __init__(self) -> None:
        self.depth = 0
        self.done = False
        self._string: list[str] | None = None  # the raw string so far, quotes included
        self._escaped = False
        self._scalar = ""

    def feed(self, text: str) -> tuple[str, int]:
        """-> (canonical text of the tokens completed, characters of ``text`` consumed); stops
        consuming at the character that closes the value."""
        out: list[str] = []
        for i, ch in enumerate(text):
            if self.done:
                return "".join(out), i
            out.append(self._char(ch))
        return "".join(out), len(text)

    def _char(self, ch: str) -> str:
        if self._string is not None:
            self._string.append(ch)
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                raw, self._string = "".join(self._string), None
                return self._close(json.dumps(json.loads(raw, strict=False), ensure_ascii=False))
            return ""
        out = ""
        if self._scalar and ch not in _SCALAR:
            raw, self._scalar = self._scalar, ""
            out = self._close(json.dumps(json.loads(raw)))
            if self.done:
                return out
        if ch in " \t\r\n":
            return out
        if ch == '"':
            self._string = [ch]
        elif ch in "{[":
            self.depth += 1
            out += ch
        elif ch in "}]":
            self.depth -= 1
            out += self._close(ch)
        elif ch == ":":
            out += ": "
        elif ch == ",":
            out += ", "
        else:
            self._scalar += ch
        return out

    def _close(self, token: str) -> str:
        if self.depth == 0:
            self.done = True
        return token


@dataclass(frozen=True)
class CallDelta:
    """One piece of call ``index``: its name (the call's first piece) or an arguments fragment."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamedCall:
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class IncrementalCalls:
    """Finds calls in the growing text after a trigger and cuts them into ``CallDelta``s."""

    fmt: str
    calls: list[StreamedCall] = field(default_factory=list)
    _text: str = ""
    _at: int = 0  # what is read of _text
    _json: JsonCanonicalizer | None = None  # the current call's arguments (JSON formats)
    _dsml_params: int = -1  # parameters written of the current DSML call; -1: none open
    # text that is no JSON (a value the grammar did not hold to): nothing more streams; the
    # answer's end parses the whole text and says what it is
    broken: bool = False

    def feed(self, text: str) -> list[CallDelta]:
        self._text += text
        out: list[CallDelta] = []
        while not self.broken:
            try:
                piece = self._step()
            except ValueError:  # json.JSONDecodeError included
                self.broken = True
                break
            if piece is None:
                break
            if piece.name is not None or piece.arguments:
                out.append(piece)
        return out

    def _step(self) -> CallDelta | None:
        """One piece, or None when the text so far holds no more."""
        if self._json is not None:
            return self._json_args()
        if self._dsml_params >= 0:
            return self._dsml_args()
        start = self._text.find(_TRIGGER[self.fmt], self._at)
        if start < 0:
            return None
        m = _HEADERS[self.fmt].match(self._text, start)
        if m is None or m.end() == len(self._text):  # incomplete (a longer match may follow)
            return None
        name = json.loads(m.group(1)) if self.fmt != "deepseek_v4" else m.group(1)
        self.calls.append(StreamedCall(name))
        self._at = m.end()
        if self.fmt == "deepseek_v4":
            self._dsml_params = 0
        else:
            self._json = JsonCanonicalizer()
        return CallDelta(len(self.calls) - 1, name=name)

    def _json_args(self) -> CallDelta | None:
        assert self._json is not None
        if self._at == len(self._text):
            return None
        frag, used = self._json.feed(self._text[self._at:])
        self._at += used
        if self._json.done:
            self._json = None
            self.calls[-1].complete = True
        return self._fragment(frag)

    def _dsml_args(self) -> CallDelta | None:
        m = _DSML_PARAM.match(self._text, self._at)
        if m is not None:
            value = m.group(3) if m.group(2) == "true" else json.loads(m.group(3), strict=False)
            frag = ("{" if self._dsml_params == 0 else ", ") + json.dumps(
                m.group(1), ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            self._dsml_params += 1
            self._at = m.end()
            return self._fragment(frag)
        m = _DSML_END.match(self._text, self._at)
        if m is not None:
            frag = "{}" if self._dsml_params == 0 else "}"
            self._dsml_params = -1
            self._at = m.end()
            self.calls[-1].complete = True
            return self._fragment(frag)
        return None

    def _fragment(self, frag: str) -> CallDelta:
        self.calls[-1].arguments += frag
        return CallDelta(len(self.calls) - 1, arguments=frag)
