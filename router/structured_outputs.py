"""The grammar a request's output must follow, from whichever field names it: OpenAI's
``response_format``, vLLM's ``structured_outputs`` {json, regex, choice, grammar, json_object,
structural_tag}, or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. One source per request: two are refused, naming the second.

The result is a (kind, spec) pair the workers compile (``worker/grammar_cache.py``):
``json_schema`` (spec: the schema's JSON text, key order kept: the model writes the keys in the
schema's order), ``json_object``, ``regex`` (spec: the pattern), ``choice`` (spec: a JSON list of
the strings), ``grammar`` (spec: EBNF text) and ``structural_tag``. Torch-free; never compiles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from router.errors import invalid_request
from router.schema_check import check_schema
from router.schemas import StructuredOutputs, _SamplingFields


@dataclass(frozen=True)
class OutputGrammar:
    kind: str   # "" = no grammar
    spec: str
    param: str  # the request field it came from, for errors


NO_GRAMMAR = OutputGrammar("", "", "")


def _schema_text(schema: dict[str, Any] | str, param: str, where: str | None = None) -> str:
    """The schema as the grammar compiler gets it, after the checks that refuse what it would
    not enforce or could not compile in time (router/schema_check.py); ``where`` names the
    schema's place in the request (default ``param``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise invalid_request(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise invalid_request(f"{param}: a JSON schema object is required", param)
    check_schema(schema, where or param)
    # never sort_keys: the grammar follows the schema's property order, which is the order the
    # model writes the keys in (a "reasoning" before an "answer" must stay first)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def response_format_grammar(fmt: dict[str, Any] | None) -> OutputGrammar:
    """OpenAI's response_format: text, json_object or json_schema."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return NO_GRAMMAR
    if kind == "json_object":
        return OutputGrammar("json_object", "", "response_format")
    if kind == "json_schema":
        js = fmt.get("json_schema") if fmt else None
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise invalid_request("response_format.json_schema.schema: a JSON schema object is "
                                  "required", "response_format.json_schema.schema")
        return OutputGrammar("json_schema", _schema_text(
            schema, "response_format", "response_format.json_schema.schema"), "response_format")
    raise invalid_request(f"response_format.type: {kind!r} is not text, json_object or "
                          "json_schema", "response_format.type")


def _regex(pattern: str, param: str) -> OutputGrammar:
    if not pattern:
        raise invalid_request(f"{param}: an empty pattern", param)
    return OutputGrammar("regex", pattern, param)


def _choice(options: list[str], param: str) -> OutputGrammar:
    if not options:
        raise invalid_request(f"{param}: at least one choice is required", param)
    if any(o == "" for o in options):
        raise invalid_request(f"{param}: empty strings cannot be chosen", param)
    return OutputGrammar("choice", json.dumps(options, ensure_ascii=False), param)


def _grammar(text: str, param: str) -> OutputGrammar:
    """EBNF as xgrammar (and llama.cpp's GBNF) write it: ``root ::= ...``. vLLM also takes Lark
    for its other backends; that syntax is refused by name rather than failing obscurely."""
    if "::=" not in text:
        looks_lark = any(":" in line.split("//")[0] for line in text.splitlines())
        syntax = "Lark (rule: ...)" if looks_lark else "this grammar syntax"
        raise invalid_request(f"{param}: {syntax} is not supported; write EBNF (GBNF) rules "
                              "`name ::= ...` with a `root` rule", param)
    return OutputGrammar("grammar", text, param)


def _structured(so: StructuredOutputs) -> OutputGrammar:
    if so.whitespace_pattern is not None:
        raise invalid_request("structured_outputs.whitespace_pattern: not supported (the JSON "
                              "is always compact)", "structured_outputs.whitespace_pattern")
    if so.disable_any_whitespace is False:
        raise invalid_request("structured_outputs.disable_any_whitespace: false is not "
                              "supported (the JSON is always compact)",
                              "structured_outputs.disable_any_whitespace")
    if so.disable_additional_properties:
        raise invalid_request("structured_outputs.disable_additional_properties: not supported "
                              "(set additionalProperties false in the schema)",
                              "structured_outputs.disable_additional_properties")
    given = [name for name in ("json", "regex", "choice", "grammar", "json_object",
                               "structural_tag")
             if getattr(so, "json_" if name == "json" else name) not in (None, False)]
    if len(given) != 1:
        raise invalid_request("structured_outputs: set exactly one of json, regex, choice, "
                              f"grammar, json_object, structural_tag (got {given or 'none'})",
                              "structured_outputs")
    name = given[0]
    param = f"structured_outputs.{name}"
    if name == "json":
        assert so.json_ is not None
        return OutputGrammar("json_schema", _schema_text(so.json_, param), param)
    if name == "regex":
        return _regex(so.regex or "", param)
    if name == "choice":
        return _choice(so.choice or [], param)
    if name == "grammar":
        return _grammar(so.grammar or "", param)
    if name == "json_object":
        return OutputGrammar("json_object", "", param)
    return OutputGrammar("structural_tag", so.structural_tag or "", param)


def output_grammar(req: _SamplingFields,
                   response_format: dict[str, Any] | None = None) -> OutputGrammar:
    """The one grammar source a request sets, or NO_GRAMMAR; two sources are a 400."""
    found: list[OutputGrammar] = []
    rf = response_format_grammar(response_format)
    if rf.kind:
        found.append(rf)
    if req.structured_outputs is not None:
        found.append(_structured(req.structured_outputs))
    if req.guided_json is not None:
        found.append(OutputGrammar("json_schema", _schema_text(req.guided_json, "guided_json"),
                                   "guided_json"))
    if req.guided_regex is not None:
        found.append(_regex(req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(_choice(req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        found.append(_grammar(req.guided_grammar, "guided_grammar"))
    if len(found) > 1:
        raise invalid_request(f"{found[1].param}: not together with {found[0].param}; one "
                              "grammar per request", found[1].param)
    return found[0] if found else NO_GRAMMAR
