"""The workload of the split benchmark, against any OpenAI-compatible router: ``num_chats``
streaming chats kept running (short prompts, ``output_tokens`` each, a new one starts when one
ends) while long prompts arrive every ``long_every_s`` seconds, cycling through
``long_tokens``. Records the arrival time of every streamed token, so inter-token latency can
be read over time next to when each long prompt arrived and got its first token.

Prompts are random lowercase letters: with the byte-level tokenizer of bench/synthetic_model.py
one character is one token, so ``long_tokens`` are (within the chat template's few tokens) the
prompt lengths the workers see.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Workload:
    num_chats: int = 16
    chat_prompt_chars: int = 64
    output_tokens: int = 256
    long_tokens: tuple[int, ...] = (8192, 32768)
    long_every_s: float = 6.0
    first_long_s: float = 4.0  # the chats reach steady state first
    long_output_tokens: int = 4
    duration_s: float = 30.0
    seed: int = 0
    # agent chats: every chat request carries ``AGENT_TOOLS`` with tool_choice auto and an
    # earlier tool call and its result, as an agent loop's turns do
    agent_tools: bool = False

    def __post_init__(self) -> None:
        for name in ("num_chats", "output_tokens", "long_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_every_s <= 0 or self.duration_s <= 0:
            raise ValueError("long_every_s and duration_s must be > 0")


@dataclass
class StreamRecord:
    kind: str  # "chat" | "long"
    prompt_chars: int
    start_s: float  # from the workload's start
    token_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.start_s if self.token_s else None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "prompt_chars": self.prompt_chars, "start_s": self.start_s,
                "ttft_s": self.ttft_s, "token_s": self.token_s,
                "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
                "error": self.error}


def _text(rng: random.Random, n: int) -> str:
    """``n`` characters of random five-letter words: a BPE tokenizer sees words (one giant
    pre-token of random letters would make its merges slow), a byte-level one a token each."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return "".join(" " if i % 6 == 5 else rng.choice(letters) for i in range(n))


AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one file of it.",
        "parameters": {"type": "object", "properties": {"target": {"type": "string"},
                                                        "timeout_s": {"type": "integer"}},
                       "required": []}}},
]


def agent_messages(prompt: str) -> list[dict[str, Any]]:
    """One agent-loop turn: the task, the model's earlier tool call, the tool's result (the
    prompt's letters), and the request for the next step."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": "src/app.py"})}}
    return [{"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Fix the failing test."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": prompt}]


async def _stream(client: httpx.AsyncClient, model: str, rec: StreamRecord, prompt: str,
                  max_tokens: int, t0: float, agent: bool = False) -> None:
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
    if agent:
        body.update(messages=agent_messages(prompt), tools=AGENT_TOOLS, tool_choice="auto")
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error']}"[:300]
                    return
                if chunk.get("usage"):
                    rec.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    rec.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("tool_calls"):
                        rec.token_s.append(time.perf_counter() - t0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]


async def _letters_per_token(client: httpx.AsyncClient, model: str) -> float:
    """Letters of ``_text`` per token, from the router's /tokenize of a sample (1.0 when the
    router does not answer it)."""
    sample = _text(random.Random(12345), 8192)
    try:
        resp = await client.post("/tokenize", json={"model": model, "prompt": sample,
                                                    "add_special_tokens": False})
        count = int(resp.json()["count"]) if resp.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError):
        count = 0
    return len(sample) / count if count else 1.0


async def run_workload(url: str, model: str, w: Workload) -> list[StreamRecord]:
    """Run the workload for ``w.duration_s`` (then let streams in flight finish)."""
    rng = random.Random(w.seed)
    records: list[StreamRecord] = []
    limits = httpx.Limits(max_connections=w.num_chats + 16, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                 limits=limits) as client:
        # letters a long prompt needs for its token count under the served tokenizer (one a
        # token with a byte-level one; a BPE packs a few letters into each)
        letters_per_token = await _letters_per_token(client, model)
        t0 = time.perf_counter()

        async def chat_lane(lane: int) -> None:
            lane_rng = random.Random(w.seed * 1000 + lane)
            await asyncio.sleep(lane * 0.05)  # stagger, so steps hold a spread of positions
            while time.perf_counter() - t0 < w.duration_s:
                rec = StreamRecord("chat", w.chat_prompt_chars, time.perf_counter() - t0)
                records.append(rec)
                await _stream(client, model, rec, _text(lane_rng, w.chat_prompt_chars),
                              w.output_tokens, t0, agent=w.agent_tools)
                if rec.error:
                    await asyncio.sleep(0.5)

        async def long_lane() -> None:
            tasks = []
            i = 0
            while True:
                at = w.first_long_s + i * w.long_every_s
                if at >= w.duration_s:
                    break
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                n = w.long_tokens[i % len(w.long_tokens)]
                rec = StreamRecord("long", n, time.perf_counter() - t0)
                records.append(rec)
                text = _text(rng, int(n * letters_per_token))
                tasks.append(asyncio.create_task(
                    _stream(client, model, rec, text, w.long_output_tokens, t0)))
                i += 1
            await asyncio.gather(*tasks)

        await asyncio.gather(long_lane(), *(chat_lane(i) for i in range(w.num_chats)))
    return records
