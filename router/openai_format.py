"""OpenAI response shapes: full responses, stream chunks, usage, and SSE framing.

Chat and completions differ only in object names and where the text goes (`message`/`delta`
vs `text`).  `return_token_ids` (vLLM extension) adds `prompt_token_ids` (top level for chat, on
the choice for completions) and `token_ids` on each choice.  This module is pure formatting: it
must never await, reach a worker or read settings.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from router.choice_runner import ChoiceDelta, ChoiceRunner
from router.job import GenerationJob
from router.logprobs_format import chat_logprobs, completion_logprobs
from router.tool_call_deltas import CallDelta
from router.tool_calls import ParsedOutput, ToolCallStream, answer_of


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def usage(job: GenerationJob, runners: Sequence[ChoiceRunner]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice), as OpenAI does."""
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(r.stats.token_ids) for r in runners)
    cached = 0
    for p_index in range(len(job.prompts)):
        choices = runners[p_index * job.n:(p_index + 1) * job.n]
        cached += max((r.stats.num_cached_tokens for r in choices), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_call_id(request_id: str, index: int, k: int) -> str:
    """The id of choice ``index``'s ``k``-th call: the same streamed and not."""
    return f"call_{request_id.rsplit('-', 1)[-1][:20]}_{index}_{k}"


def streamed_tool_calls(deltas: Sequence[CallDelta], request_id: str,
                        index: int) -> list[dict[str, Any]]:
    """OpenAI's streamed tool_calls of one chunk: a call's first piece carries its id, type and
    name; the arguments fragments of one call in a row are joined."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.name is not None:
            out.append({"index": d.index, "id": tool_call_id(request_id, index, d.index),
                        "type": "function", "function": {"name": d.name, "arguments": ""}})
        elif out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def tool_calls_json(parsed: ParsedOutput, request_id: str, index: int) -> list[dict[str, Any]]:
    """OpenAI tool_calls of a whole answer; ids derive from the request id, choice and position."""
    return [{"id": tool_call_id(request_id, index, k), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for k, c in enumerate(parsed.calls)]


def full_response(job: GenerationJob, request_id: str, created: int,
                  runners: Sequence[ChoiceRunner]) -> dict[str, Any]:
    choices = []
    for r in sorted(runners, key=lambda r: r.spec.index):
        choice: dict[str, Any] = {"index": r.spec.index, "logprobs": None,
                                  "finish_reason": r.stats.finish_reason}
        if job.logprobs is not None:
            choice["logprobs"] = (
                chat_logprobs(r.stats.logprobs) if job.kind == "chat" else
                # echo with logprobs: the prompt's tokens first, from offset 0
                completion_logprobs(r.stats.prompt_logprobs + r.stats.logprobs, 0)
                if r.stats.prompt_logprobs else
                completion_logprobs(r.stats.logprobs, r.stats.echo_len))
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": r.stats.text}
            if job.tool_format is not None:
                parsed = answer_of(job.tool_format, r.stats.text)
                if parsed.calls:
                    choice["message"] = {"role": "assistant", "content": parsed.content,
                                         "tool_calls": tool_calls_json(parsed, request_id,
                                                                       r.spec.index)}
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = r.stats.text
            if job.return_token_ids:
                choice["prompt_token_ids"] = list(r.spec.prompt_token_ids)
        if job.return_token_ids:
            choice["token_ids"] = list(r.stats.token_ids)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": request_id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": created, "model": job.model, "choices": choices,
        "usage": usage(job, runners)}
    if job.kind == "chat" and job.return_token_ids:
        body["prompt_token_ids"] = list(job.prompts[0])
    return body


@dataclass
class ChunkWriter:
    """Builds the SSE chunks of one streamed request."""

    job: GenerationJob
    request_id: str
    created: int
    # completions logprobs: each choice's text offset so far
    _offsets: dict[int, int] = field(default_factory=dict)
    # chat with tools: each choice's tool-call detector
    _tools: dict[int, ToolCallStream] = field(default_factory=dict)

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.job.kind == "chat" else "text_completion",
            "created": self.created, "model": self.job.model, "choices": choices}
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[str]:
        """Chat: one chunk per choice with the assistant role (and prompt ids when asked)."""
        if self.job.kind != "chat":
            return []
        out = []
        for index in range(self.job.num_choices):
            chunk = self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            if self.job.return_token_ids and index == 0:
                chunk["prompt_token_ids"] = list(self.job.prompts[0])
            out.append(sse(chunk))
        return out

    def delta(self, d: ChoiceDelta, first_of_choice: bool) -> str | None:
        if not d.text and not d.token_ids and d.finish_reason is None:
            return None
        choice: dict[str, Any] = {"index": d.index, "logprobs": None,
                                  "finish_reason": d.finish_reason}
        if self.job.logprobs is not None and d.logprobs:
            if self.job.kind == "chat":
                choice["logprobs"] = chat_logprobs(d.logprobs)
            else:
                choice["logprobs"] = completion_logprobs(d.logprobs,
                                                         self._offsets.get(d.index, 0))
        if self.job.kind != "chat":
            grown = len(d.text) if not d.token_ids else sum(len(e.token) for e in d.logprobs)
            self._offsets[d.index] = self._offsets.get(d.index, 0) + grown
        if self.job.kind == "chat":
            text = d.text
            fmt = self.job.tool_format
            calls: list[CallDelta] = []
            if fmt is not None:
                stream = self._tools.setdefault(d.index, ToolCallStream(fmt))
                text = stream.add(d.text)
                calls = stream.take_deltas()
            if fmt is not None and d.finish_reason is not None:
                rest, rest_calls, parsed = stream.finish()
                text += rest
                calls += rest_calls
                if parsed.calls and d.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            choice["delta"] = {"content": text} if text else {}
            if calls:
                choice["delta"]["tool_calls"] = streamed_tool_calls(calls, self.request_id,
                                                                    d.index)
        else:
            choice["text"] = d.text
            if self.job.return_token_ids and first_of_choice:
                choice["prompt_token_ids"] = list(self.job.prompts[d.index // self.job.n])
        if self.job.return_token_ids:
            choice["token_ids"] = list(d.token_ids)
        return sse(self._chunk([choice]))

    def usage_chunk(self, runners: Sequence[ChoiceRunner]) -> str:
        chunk = self._chunk([])
        chunk["usage"] = usage(self.job, runners)
        return sse(chunk)
