"""`bulkhead bench`: a bounded load generator for any OpenAI-compatible endpoint.

(`bulkhead bench split OUT ...` is the other measurement: a one-box split deployment against a
colocated worker under long prompts, bench/split.py; it needs the engine and a GPU.)

Sends streamed chat or completion requests at a request rate (Poisson arrivals) or a fixed
concurrency, with synthetic prompts of a given length (plus, optionally, a long prompt every
k-th request), and measures per request the time to first token, the gaps between tokens and the
end-to-end latency.  Prints a table of p50/p90/p99/max and throughput, writes JSON and a PNG plot
(bench/load_plot.py).

Bounded by construction: a number of requests, an optional duration, a concurrency cap and a
per-request timeout.  Must never import torch (it runs on any client machine); matplotlib is
imported only to draw the plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load_report import RequestRecord, format_table, summarize
from common.help_format import DefaultsHelpFormatter

# Common English words: each is one token in most BPE vocabularies, so N words ~ N tokens.
_WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had", "first",
    "one", "their", "its", "new", "after", "who", "they", "two", "her", "she", "been", "other",
    "when", "there", "all", "also", "into", "during", "time", "only", "may", "over", "about",
    "more", "most", "some", "city", "world", "state", "year", "school", "through", "where", "many",
    "these", "then", "them", "both", "such", "up", "out", "between", "under", "while", "however",
    "would", "could", "people", "known", "part", "later", "each", "well", "before",
)


class BenchError(ValueError):
    """A bench option is unusable; the message names it."""


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str = ""  # "" = the first model of GET /v1/models
    endpoint: str = "completions"  # "completions" | "chat"
    num_requests: int = 100
    duration_s: float = 0.0  # stop sending after this long; 0 = no time bound
    request_rate: float = math.inf  # requests per second (Poisson); inf = as fast as allowed
    # Most requests in flight. The workers' default max_batch is 8: a default above it would
    # measure the queue the bench itself builds, not the server.
    concurrency: int = 8
    prompt_tokens: int = 128  # approximate, in words
    output_tokens: int = 64  # max_tokens of every request
    long_prompt_tokens: int = 0  # a long prompt of this length ...
    long_prompt_every: int = 0  # ... every k-th request (0 = never)
    ignore_eos: bool = True  # ask for exactly output_tokens (vLLM extension)
    timeout_s: float = 300.0  # per request
    seed: int = 0
    api_key: str = ""
    out_json: str = ""
    out_png: str = ""

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise BenchError(f"endpoint: {self.endpoint!r} is not 'completions' or 'chat'")
        for name in ("num_requests", "concurrency", "prompt_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.request_rate <= 0:
            raise BenchError(f"request_rate: {self.request_rate} must be > 0")
        if self.duration_s < 0 or self.timeout_s <= 0:
            raise BenchError("duration_s must be >= 0 and timeout_s > 0")
        if self.long_prompt_every < 0 or self.long_prompt_tokens < 0:
            raise BenchError("long_prompt_every and long_prompt_tokens must be >= 0")
        if self.long_prompt_every and not self.long_prompt_tokens:
            raise BenchError("long_prompt_every needs long_prompt_tokens > 0")


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _body(cfg: BenchConfig, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": cfg.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    out = ""
    for choice in chunk.get("choices") or []:
        if "delta" in choice:
            out += (choice["delta"] or {}).get("content") or ""
        else:
            out += choice.get("text") or ""
    return out


async def _one(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    rec: RequestRecord,
    prompt: str,
    t0: float,
) -> None:
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    started = time.perf_counter()
    rec.start_s = started - t0
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", path, json=_body(cfg, model, prompt)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    rec.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    rec.prompt_tokens = int(chunk["usage"].get("prompt_tokens") or 0)
                if _chunk_text(chunk):
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        rec.ttft_s = now - started
                    else:
                        rec.itl_s.append(now - last)
                    last = now
        rec.e2e_s = time.perf_counter() - started
        if not rec.output_tokens:
            rec.output_tokens = chunks
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


async def _resolve_model(client: httpx.AsyncClient, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


async def run_bench(cfg: BenchConfig) -> tuple[list[RequestRecord], float, str]:
    """Run the load; return the records, the wall time of the run and the model id used."""
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=cfg.base_url.rstrip("/"), headers=headers, timeout=cfg.timeout_s, limits=limits
    ) as client:
        model = await _resolve_model(client, cfg)
        gate = asyncio.Semaphore(cfg.concurrency)
        records: list[RequestRecord] = []
        tasks: list[asyncio.Task[None]] = []

        async def guarded(rec: RequestRecord, prompt: str, t0: float) -> None:
            async with gate:
                await _one(client, cfg, model, rec, prompt, t0)

        t0 = time.perf_counter()
        next_at = 0.0
        for i in range(cfg.num_requests):
            if cfg.duration_s and time.perf_counter() - t0 >= cfg.duration_s:
                break
            long = cfg.long_prompt_every and (i + 1) % cfg.long_prompt_every == 0
            words = cfg.long_prompt_tokens if long else cfg.prompt_tokens
            rec = RequestRecord(index=i, prompt_words=words)
            records.append(rec)
            if math.isfinite(cfg.request_rate):
                next_at += rng.expovariate(cfg.request_rate)
                delay = t0 + next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            # the semaphore bounds in-flight requests; tasks wait their turn
            tasks.append(asyncio.create_task(guarded(rec, _prompt(rng, words), t0)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0, model


def describe_run(cfg: BenchConfig, model: str, summary: dict[str, Any]) -> dict[str, Any]:
    """What the run was, for the JSON and the plot's title: model, endpoint, offered load."""
    done = summary["completed"]
    return {
        "model": model or cfg.model,
        "endpoint": cfg.endpoint,
        "concurrency": cfg.concurrency,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else None,
        "prompt_tokens_per_request": (round(summary["prompt_tokens"] / done) if done
                                      else cfg.prompt_tokens),
        "output_tokens_per_request": cfg.output_tokens,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bulkhead bench", description=__doc__.split("\n")[0],
                                formatter_class=DefaultsHelpFormatter)
    d = BenchConfig()
    p.add_argument("--base-url", default=d.base_url, help="server root (without /v1)")
    p.add_argument("--model", default=d.model, help="default: first model of /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default=d.endpoint,
                   help="/v1/completions or /v1/chat/completions")
    p.add_argument("--num-requests", type=int, default=d.num_requests,
                   help="requests to send (the hard bound)")
    p.add_argument(
        "--duration-s",
        type=float,
        default=d.duration_s,
        help="stop sending after this many seconds (0 = only --num-requests)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=d.request_rate,
        help="requests per second, Poisson arrivals (default: inf)",
    )
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="most requests in flight")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help="prompt length in words (~tokens); the JSON has the real counts")
    p.add_argument("--output-tokens", type=int, default=d.output_tokens,
                   help="max_tokens of each request")
    p.add_argument("--long-prompt-tokens", type=int, default=d.long_prompt_tokens,
                   help="length of the occasional long prompt (words)")
    p.add_argument("--long-prompt-every", type=int, default=d.long_prompt_every,
                   help="every k-th request gets the long prompt (0 = never)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="turn ignore_eos off: let requests stop at EOS instead of "
                   "asking for exactly --output-tokens")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per-request timeout")
    p.add_argument("--seed", type=int, default=d.seed, help="prompts and arrival times")
    p.add_argument("--api-key", default=d.api_key, help="sent as a Bearer token")
    p.add_argument("--out-json", default="bench.json", help="'' to skip")
    p.add_argument("--out-png", default="bench.png", help="'' to skip")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["split"]:  # imported only here: the load generator never imports torch
        from bench.split import main as split_main

        return split_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        cfg = BenchConfig(**vars(args))
    except BenchError as exc:
        print(f"bulkhead bench: {exc}", file=sys.stderr)
        return 2
    try:
        records, wall_s, model = asyncio.run(run_bench(cfg))
    except httpx.HTTPError as exc:
        print(f"bulkhead bench: cannot reach {cfg.base_url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(records, wall_s)
    summary = {**describe_run(cfg, model, summary), **summary}
    print(format_table(summary))
    if cfg.out_json:
        out = {
            "config": {
                k: (None if isinstance(v, float) and math.isinf(v) else v)
                for k, v in asdict(cfg).items()
                if k != "api_key"
            },
            "summary": summary,
            "requests": [asdict(r) for r in records],
        }
        Path(cfg.out_json).write_text(json.dumps(out, indent=1))
    if cfg.out_png:
        from bench.load_plot import plot

        plot(summary, records, cfg.out_png)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
