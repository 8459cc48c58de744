"""The bad-input classes thrown at the router's edge, each with the answer it must get.

A case is what a client can send: a JSON value (sent as a body), raw body bytes, or a whole
raw request (head and body) for what an HTTP library would refuse to produce.  ``status`` is
the expected answer; ``param`` the field the error must name (None: not checked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MODEL = "tiny"
LIMIT = 1024 * 1024
MSG = [{"role": "user", "content": "Hi"}]


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    status: int
    param: str | None = None
    code: str | None = None
    endpoint: str = "chat/completions"
    body: Any = None                 # JSON value; with raw None, json-encoded (ASCII escapes)
    raw: bytes | None = None         # body bytes as they are
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    path: str | None = None          # overrides /v1/<endpoint>
    request: bytes | None = None     # a whole raw HTTP request (head + body)


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **kw}


def _raw_request(head_lines: list[str], body: bytes = b"") -> bytes:
    head = "\r\n".join(["POST /v1/chat/completions HTTP/1.1", "host: 127.0.0.1", *head_lines])
    return head.encode("latin-1") + b"\r\n\r\n" + body


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _deep(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


_OK = json.dumps(chat()).encode()
S = "\ud800"   # a lone surrogate: valid JSON escape, invalid Unicode

CASES: list[Case] = [
    # --- encodings -----------------------------------------------------------------------
    Case("lone high surrogate in message content", "encoding", 400, "messages[0].content",
         "invalid_unicode", body=chat(messages=[{"role": "user", "content": f"a{S}b"}])),
    Case("lone low surrogate in message content", "encoding", 400, "messages[0].content",
         "invalid_unicode", body=chat(messages=[{"role": "user", "content": "\udfff"}])),
    Case("surrogate in a content part's text", "encoding", 400, "messages[0].content[0].text",
         "invalid_unicode", body=chat(messages=[{"role": "user", "content": [
             {"type": "text", "text": S}]}])),
    Case("surrogate in message name", "encoding", 400, "messages[0].name", "invalid_unicode",
         body=chat(messages=[{"role": "user", "content": "x", "name": S}])),
    Case("surrogate in model name", "encoding", 400, "model", "invalid_unicode",
         body=chat(model=S)),
    Case("surrogate in stop string", "encoding", 400, "stop", "invalid_unicode",
         body=chat(stop=S)),
    Case("surrogate in second stop string", "encoding", 400, "stop[1]", "invalid_unicode",
         body=chat(stop=["a", S])),
    Case("surrogate in user", "encoding", 400, "user", "invalid_unicode", body=chat(user=S)),
    Case("surrogate in completion prompt", "encoding", 400, "prompt", "invalid_unicode",
         endpoint="completions", body=comp(prompt=S)),
    Case("surrogate in a prompt of a list", "encoding", 400, "prompt[1]", "invalid_unicode",
         endpoint="completions", body=comp(prompt=["a", S])),
    Case("surrogate in an unknown field", "encoding", 400, "metadata.x", "invalid_unicode",
         body=chat(metadata={"x": S})),
    Case("surrogate in a key", "encoding", 400, "body", "invalid_unicode",
         body={**chat(), S: 1}),
    Case("surrogate in response_format", "encoding", 400, "response_format.type",
         "invalid_unicode", body=chat(response_format={"type": S})),
    Case("raw byte 0xff in the body", "encoding", 400, "body",
         raw=_OK.replace(b'"Hi"', b'"H\xffi"')),
    Case("overlong UTF-8 (0xc0 0xaf)", "encoding", 400, "body", raw=_OK.replace(b'"Hi"', b'"\xc0\xaf"')),
    Case("UTF-8 encoded surrogate (0xed 0xa0 0x80)", "encoding", 400,
         raw=_OK.replace(b'"Hi"', b'"\xed\xa0\x80"')),
    Case("body in UTF-16", "encoding", 200, raw=_OK.decode().encode("utf-16")),
    Case("body with a UTF-8 BOM (accepted, as RFC 8259 allows)", "encoding", 200, raw=b"\xef\xbb\xbf" + _OK),
    Case("Latin-1 body declared as such", "encoding", 400, "body",
         raw=_OK.replace(b'"Hi"', '"Hé"'.encode("latin-1")),
         headers={"content-type": "application/json; charset=latin-1"}),
    Case("NUL character in content (valid Unicode)", "encoding", 200,
         body=chat(messages=[{"role": "user", "content": "a\u0000b"}])),
    Case("surrogate pair escapes (valid emoji)", "encoding", 200,
         raw=_OK.replace(b'"Hi"', b'"\\ud83d\\ude00"')),
    Case("non-characters U+FFFE U+FFFF", "encoding", 200,
         body=chat(messages=[{"role": "user", "content": "\ufffe\uffff"}])),
    # --- JSON structure and nesting --------------------------------------------------------
    Case("empty body", "nesting", 400, raw=b""),
    Case("truncated JSON", "nesting", 400, "body", "invalid_json", raw=_OK[:-5]),
    Case("trailing garbage after JSON", "nesting", 400, raw=_OK + b"xyz"),
    Case("body is an array", "nesting", 400, "body", raw=b"[1, 2]"),
    Case("body is a string", "nesting", 400, "body", raw=b'"hello"'),
    Case("body is null", "nesting", 400, raw=b"null"),
    Case("body is a number", "nesting", 400, "body", raw=b"42"),
    Case("messages is an object", "nesting", 400, "messages",
         body=chat(messages={"role": "user", "content": "x"})),
    Case("message is a string", "nesting", 400, "messages[0]", body=chat(messages=["hi"])),
    Case("content is an object", "nesting", 400, "messages[0].content",
         body=chat(messages=[{"role": "user", "content": {"text": "x"}}])),
    Case("content part of another type", "nesting", 400, "messages[0].content[0].type",
         "unsupported_content",
         body=chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    Case("image part after a text part", "nesting", 400, "messages[1].content[1].type",
         "unsupported_content",
         body=chat(messages=[MSG[0], {"role": "user", "content": [
             {"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])),
    Case("10,000-deep array in an unknown field", "nesting", 400, "body",
         raw=_OK[:-1] + b',"x":' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    Case("500-deep array in an unknown field (ignored)", "nesting", 200,
         raw=_OK[:-1] + b',"x":' + b"[" * 500 + b"]" * 500 + b"}"),
    Case("duplicate key (last wins)", "nesting", 200,
         raw=_OK[:-1] + b',"max_tokens":3}'),
    Case("NaN temperature", "nesting", 400, "temperature", raw=_OK[:-1] + b',"temperature":NaN}'),
    Case("Infinity top_p", "nesting", 400, "top_p", raw=_OK[:-1] + b',"top_p":Infinity}'),
    Case("1e400 temperature (overflows to inf)", "nesting", 400, "temperature",
         raw=_OK[:-1] + b',"temperature":1e400}'),
    Case("5,000-digit integer", "nesting", 400, "body", raw=_OK[:-1] + b',"seed":' + b"9" * 5000 + b"}"),
    # --- types (no coercion) ---------------------------------------------------------------
    Case('max_tokens "10"', "types", 400, "max_tokens", body=chat(max_tokens="10")),
    Case("max_tokens true", "types", 400, "max_tokens", body=chat(max_tokens=True)),
    Case("max_tokens 10.0", "types", 400, "max_tokens", body=chat(max_tokens=10.0)),
    Case("max_tokens 2.5", "types", 400, "max_tokens", body=chat(max_tokens=2.5)),
    Case('stream "yes"', "types", 400, "stream", body=chat(stream="yes")),
    Case("stream 1", "types", 400, "stream", body=chat(stream=1)),
    Case('temperature "0.5"', "types", 400, "temperature", body=chat(temperature="0.5")),
    Case("temperature true", "types", 400, "temperature", body=chat(temperature=True)),
    Case('n "2"', "types", 400, "n", body=chat(n="2")),
    Case('seed "1"', "types", 400, "seed", body=chat(seed="1")),
    Case("top_k 1.0", "types", 400, "top_k", body=chat(top_k=1.0)),
    Case("stop 5", "types", 400, "stop", body=chat(stop=5)),
    Case("stop [1, 2]", "types", 400, "stop[0]", body=chat(stop=[1, 2])),
    Case('stop_token_ids ["1"]', "types", 400, "stop_token_ids[0]",
         body=chat(stop_token_ids=["1"])),
    Case("role 5", "types", 400, "messages[0].role",
         body=chat(messages=[{"role": 5, "content": "x"}])),
    Case("content 5", "types", 400, "messages[0].content",
         body=chat(messages=[{"role": "user", "content": 5}])),
    Case("model 5", "types", 400, "model", body=chat(model=5)),
    Case("user 5", "types", 400, "user", body=chat(user=5)),
    Case('ignore_eos "false"', "types", 400, "ignore_eos", body=chat(ignore_eos="false")),
    Case("ignore_eos 0", "types", 400, "ignore_eos", body=chat(ignore_eos=0)),
    Case('stream_options "yes"', "types", 400, "stream_options",
         body=chat(stream=True, stream_options="yes")),
    Case('include_usage "true"', "types", 400, "stream_options.include_usage",
         body=chat(stream=True, stream_options={"include_usage": "true"})),
    Case('logprobs "true"', "types", 400, "logprobs", body=chat(logprobs="true")),
    Case("prompt true", "types", 400, "prompt", endpoint="completions", body=comp(prompt=True)),
    Case("prompt [1.5]", "types", 400, "prompt[0]", endpoint="completions", body=comp(prompt=[1.5])),
    Case('prompt [[1, "a"]]', "types", 400, "prompt[0][1]", endpoint="completions",
         body=comp(prompt=[[1, "a"]])),
    Case('echo "no"', "types", 400, "echo", endpoint="completions", body=comp(echo="no")),
    # --- sizes and limits -------------------------------------------------------------------
    Case("body over the limit (Content-Length)", "sizes", 413, "body", "request_too_large",
         raw=_OK[:-1] + b',"x":"' + b"a" * (LIMIT + 10) + b'"}'),
    Case("prompt certainly over the context, from its length", "sizes", 400, "messages",
         "context_length_exceeded",
         body=chat(messages=[{"role": "user", "content": "word " * 150_000}])),
    Case("prompt over the context once tokenized", "sizes", 400, "messages",
         "context_length_exceeded",
         body=chat(messages=[{"role": "user", "content": "hello " * 3000}])),
    Case("completion prompt over the context", "sizes", 400, "prompt",
         "context_length_exceeded", endpoint="completions", body=comp(prompt=[5] * 2048)),
    Case("max_tokens 2**40", "sizes", 400, "messages", "context_length_exceeded",
         body=chat(max_tokens=2**40)),
    Case("max_tokens 0", "sizes", 400, "max_tokens", body=chat(max_tokens=0)),
    Case("n 17 (limit 16)", "sizes", 400, "n", body=chat(n=17)),
    Case("17 stop strings (limit 16)", "sizes", 400, "stop", body=chat(stop=["s"] * 17)),
    Case("65 prompts (limit 64)", "sizes", 400, "prompt", endpoint="completions",
         body=comp(prompt=["a"] * 65)),
    Case("token id past the vocabulary", "sizes", 400, "prompt", endpoint="completions",
         body=comp(prompt=[1, 10**6])),
    Case("logit_bias on a token id past the vocabulary", "sizes", 400, "logit_bias",
         body=chat(logit_bias={"1000000": 5})),
    Case("negative token id", "sizes", 400, "prompt", endpoint="completions",
         body=comp(prompt=[1, -1])),
    Case("seed 2**64", "sizes", 400, "seed", body=chat(seed=2**64)),
    Case("top_k 2**31", "sizes", 400, "top_k", body=chat(top_k=2**31)),
    Case("temperature 2.5", "sizes", 400, "temperature", body=chat(temperature=2.5)),
    Case("empty messages", "sizes", 400, "messages", body=chat(messages=[])),
    Case("empty stop string", "sizes", 400, "stop", body=chat(stop="")),
    Case("min_tokens 2**64 without max_tokens", "sizes", 400, "min_tokens",
         body={"model": MODEL, "messages": MSG, "min_tokens": 2**64}),
    Case("min_tokens past the context without max_tokens", "sizes", 400, "min_tokens",
         body={"model": MODEL, "messages": MSG, "min_tokens": 100_000}),
    Case("repetition_penalty 1e-45 (1/r overflows)", "sizes", 400, "repetition_penalty",
         body=chat(repetition_penalty=1e-45)),
    Case("temperature 1e-45 (greedy below 1e-5)", "sizes", 200, body=chat(temperature=1e-45)),
    Case("logit_bias key in Arabic-Indic digits", "sizes", 400, "logit_bias",
         body=chat(logit_bias={"\u0663": 1})),
    Case("logit_bias key with an underscore", "sizes", 400, "logit_bias",
         body=chat(logit_bias={"1_0": 1})),
    # --- grammars (structured output, tools) ----------------------------------------------------
    *[Case(f"json_schema with {key!r} (not enforced)", "grammar", 400,
           "response_format.json_schema.schema", "unsupported_schema_keyword",
           body=chat(response_format=_schema({key: value})))
      for key, value in [("allOf", [{"type": "integer"}, {"minimum": 5}]), ("not", {"type": "string"}),
                         ("if", {"type": "integer"}), ("uniqueItems", True),
                         ("contains", {"const": 1}), ("dependentRequired", {"a": ["b"]})]],
    Case('json_schema with "type": []', "grammar", 400, "response_format.json_schema.schema",
         "unsupported_schema_keyword", body=chat(response_format=_schema({"type": []}))),
    Case("a property named 'not' (a name, not the keyword)", "grammar", 200,
         body=chat(response_format=_schema({"type": "object", "properties": {
             "not": {"type": "string"}}}))),
    Case("json_schema 250 levels deep", "grammar", 400, "response_format.json_schema.schema",
         "schema_too_deep", body=chat(response_format=_schema(_deep(250)))),
    Case("json_schema of 5,000 properties", "grammar", 400, "response_format.json_schema.schema",
         "schema_too_large", body=chat(response_format=_schema({"type": "object", "properties": {
             f"p{i}": {"type": "integer"} for i in range(5000)}}))),
    Case("tool parameters with 'allOf'", "grammar", 400, "tools[0].function.parameters",
         "unsupported_schema_keyword", body=chat(tools=[{"type": "function", "function": {
             "name": "f", "parameters": {"type": "object", "allOf": []}}}])),
    Case("tool name with a trailing newline", "grammar", 400, "tools[0].function.name",
         body=chat(tools=[{"type": "function", "function": {"name": "f\n"}}])),
    Case("response_format on /v1/completions (honoured)", "grammar", 200,
         endpoint="completions", body=comp(response_format={"type": "json_object"})),
    Case("response_format on /v1/completions with 'not'", "grammar", 400,
         "response_format.json_schema.schema", "unsupported_schema_keyword",
         endpoint="completions", body=comp(response_format=_schema({"not": {}}))),
    Case("10 KB model name", "sizes", 404, "model", "model_not_found", body=chat(model="m" * 10_000)),
    # --- headers and protocol ----------------------------------------------------------------
    Case("content-type text/plain", "headers", 400, raw=_OK,
         headers={"content-type": "text/plain"}),
    Case("content-type application/x-www-form-urlencoded", "headers", 400, raw=b"a=1&b=2",
         headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("GET on a POST route", "headers", 405, method="GET"),
    Case("PUT on a POST route", "headers", 405, method="PUT", raw=_OK),
    Case("unknown route", "headers", 404, path="/v1/embeddings", raw=_OK),
    Case("invalid percent-encoding in the path", "headers", 404, path="/v1/%ff%fe", raw=_OK),
    Case("query string garbage (ignored)", "headers", 200, path="/v1/chat/completions?%ff=%00",
         raw=_OK),
    Case("authorization with non-ASCII bytes (no keys set)", "headers", 200,
         request=_raw_request(["content-type: application/json", f"content-length: {len(_OK)}",
                               "authorization: Bearer \xff\xfe"], _OK)),
    Case("Content-Length not a number", "headers", 400,
         request=_raw_request(["content-type: application/json", "content-length: abc"], _OK)),
    Case("negative Content-Length", "headers", 400,
         request=_raw_request(["content-type: application/json", "content-length: -5"], _OK)),
    Case("Content-Length and chunked together (refused, RFC 9112 6.1)", "headers", 400,
         "body", "ambiguous_framing",
         request=_raw_request(["content-type: application/json", f"content-length: {len(_OK)}",
                               "transfer-encoding: chunked"],
                              b"%x\r\n%s\r\n0\r\n\r\n" % (len(_OK), _OK))),
    Case("Content-Length shorter than the body", "headers", 400,
         request=_raw_request(["content-type: application/json", "content-length: 20"], _OK)),
    Case("1 MB header (past max_header_bytes)", "headers", 431,
         request=_raw_request(["content-type: application/json", f"content-length: {len(_OK)}",
                               "x-big: " + "a" * 1_000_000], _OK)),
    Case("200 kB header (past max_header_bytes)", "headers", 431,
         request=_raw_request(["content-type: application/json", f"content-length: {len(_OK)}",
                               "x-big: " + "a" * 200_000], _OK)),
    Case("Expect: 100-continue with a 50 MB Content-Length", "headers", 413, "body",
         "request_too_large",
         request=_raw_request(["content-type: application/json", "expect: 100-continue",
                               f"content-length: {50 * 1024 * 1024}"])),
]
