"""Grammars for constrained decoding, compiled off the engine thread and cached per worker.

A request names its grammar as (kind, spec) text (``proto`` SamplingParams.grammar_kind /
grammar_spec): ``json_object`` (any JSON object), ``json_schema`` (spec: the schema, strict),
``structural_tag`` (spec: an xgrammar structural tag), ``regex`` (spec: the pattern), ``choice``
(spec: a JSON list of strings, one of which is the whole output), ``grammar`` (spec: EBNF text)
or ``tool_calls`` (spec: {"format",
"tools", "tool_choice", "parallel_tool_calls"}; the model's own tool-call syntax, built by
xgrammar's per-model structural tags). ``GrammarCache.compile`` runs on a thread of the worker's
grammar pool (``worker/grammar_pool.py``); the engine only ever gets the compiled result.
The tokenizer's xgrammar view is built once, on the first request that needs it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from engine.errors import InvalidRequest

KINDS = ("json_object", "json_schema", "structural_tag", "tool_calls", "regex", "choice",
         "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a grammar spec is JSON text; past this it is refused


class GrammarCache:
    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = 64) -> None:
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._max_entries = max_entries
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                from common.tokenizer import Tokenizer

                tok = Tokenizer.from_path(self._model_path)
                stops = list(dict.fromkeys([*self._stop_token_ids, *tok.eos_token_ids]))
                info = xgr.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=tok.backend),
                    vocab_size=self._vocab_size, stop_token_ids=stops)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    @staticmethod
    def check(kind: str, spec: str) -> None:
        """Refuse an unknown kind or an oversized spec (InvalidRequest naming the field)."""
        if kind not in KINDS:
            raise InvalidRequest(f"grammar kind {kind!r} is not one of {', '.join(KINDS)}",
                                 "response_format")
        if len(spec) > MAX_SPEC_CHARS:
            raise InvalidRequest(f"the grammar spec has {len(spec)} characters, the limit is "
                                 f"{MAX_SPEC_CHARS}", field_of(kind))

    def cached(self, kind: str, spec: str) -> Any:
        """The compiled grammar of (kind, spec) if it is in the cache, else None."""
        key = (kind, spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        return None

    def compile(self, kind: str, spec: str) -> Any:
        """The compiled grammar of (kind, spec), from the cache or built now (blocking: call it
        from a thread, ``worker/grammar_pool.py``); raises InvalidRequest naming the field the
        router filled it from."""
        self.check(kind, spec)
        hit = self.cached(kind, spec)
        if hit is not None:
            return hit
        key = (kind, spec)
        compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, kind, spec)
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar's errors for bad schemas / tags
            raise InvalidRequest(f"{field_of(kind)}: cannot build a grammar from it: "
                                 f"{_library_message(exc)}", field_of(kind)) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return compiled


_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def _library_message(exc: Exception) -> str:
    """xgrammar's message without the log prefix it carries from C++ (time, source file and
    line: nothing a client can act on), on one line."""
    text = str(exc).strip()
    return " ".join(_LOG_PREFIX.sub("", text).split()) or type(exc).__name__


def field_of(kind: str) -> str:
    if kind in ("regex", "choice", "grammar"):
        return "structured_outputs"
    return "tools" if kind == "tool_calls" else "response_format"


def choice_ebnf(options: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def _compile(compiler: Any, kind: str, spec: str) -> Any:
    import xgrammar as xgr

    # Compact JSON (no free whitespace between tokens): still JSON, and a small model cannot
    # loop on blanks until max_tokens.
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, strict_mode=True, any_whitespace=False)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(spec)))
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    req = json.loads(spec)
    choice = req.get("tool_choice", "auto")
    parallel = bool(req.get("parallel_tool_calls", True))
    tag = xgr.get_model_structural_tag(
        req["format"], tools=req["tools"], tool_choice=choice, reasoning="disabled",
        parallel_tool_calls=parallel,
        max_whitespace_cnt=2)  # a small model cannot loop on blanks inside the arguments
    return compiler.compile_structural_tag(json.dumps(_calls_only(
        json.loads(tag.model_dump_json()), choice, parallel)))


def _calls_only(tag: dict[str, Any], choice: Any, parallel: bool) -> dict[str, Any]:
    """Under "required" or a named function the answer is the calls and nothing after them:
    xgrammar's triggered tags let free text follow the calls, so they become a run of the same
    tags that ends the output (the grammar then only allows EOS)."""
    fmt = tag.get("format", {})
    if choice == "auto" or fmt.get("type") != "triggered_tags":
        return tag
    return {**tag, "format": {"type": "tags_with_separator", "tags": fmt["tags"],
                              "separator": "\n", "at_least_one": True,
                              "stop_after_first": not parallel}}
