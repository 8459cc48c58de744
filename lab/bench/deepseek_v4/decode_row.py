"""One row of ``lab.bench.deepseek_v4.decode``: B requests of one prompt length through the
engine, untimed prefill then timed decode steps; every request is aborted before it returns."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from engine.errors import EngineError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from lab.bench.deepseek_v4.context import _sync


class _DeadlinePassed(Exception):
    pass


def _count(outs: list[RequestOutput], new: dict[str, int]) -> tuple[int, int]:
    """Add each output's new tokens to ``new``; (tokens, finished requests) of this step. A
    request the engine ended alone because its step raised (engine/step_isolation.py) raises
    that error here, so the row records why (an out-of-memory step is recorded as one)."""
    tokens = finished = 0
    for o in outs:
        if o.finish_reason == "error" and o.request_id in new:
            cause = getattr(o.error, "__cause__", None) or o.error
            if isinstance(cause, torch.OutOfMemoryError) or "out of memory" in str(o.error):
                raise torch.OutOfMemoryError(_oom_text(str(o.error)))
            raise EngineError(f"{o.request_id} ended: {o.error}")
        if o.request_id in new:
            new[o.request_id] += len(o.new_token_ids)
            tokens += len(o.new_token_ids)
            finished += o.finished
    return tokens, finished


def _oom_text(text: str) -> str:
    """The device's own out-of-memory message from an engine error that quotes it."""
    at = text.find("CUDA out of memory")
    return (text[at:] if at >= 0 else text).split("; this request")[0]


def max_tokens_for(batch: int, prompt: int, chunk: int, steps: int, warm_steps: int) -> int:
    """Enough output that no request finishes before the timed steps end: the timed and warm
    steps, 8 spare, and a bound on the prefill steps (in which early requests already decode)."""
    prefill_steps = math.ceil(batch * prompt / max(1, chunk - batch)) + 1
    return steps + warm_steps + 8 + prefill_steps


def run_row(engine: LLMEngine, batch: int, prompt: int, args: argparse.Namespace,
            stop_at: float) -> dict[str, Any]:
    """B requests of ``prompt`` random tokens: untimed prefill, then ``args.steps`` timed decode
    steps; every request is aborted before returning."""
    ec = engine.config
    cuda = ec.torch_device.type == "cuda"
    row: dict[str, Any] = {"batch": batch, "prompt": prompt, "steps": args.steps, "error": None}
    max_tokens = max_tokens_for(batch, prompt, ec.chunk_tokens, args.steps, args.warm_steps)
    if prompt + max_tokens > ec.max_context:
        row["error"] = f"prompt {prompt} + {max_tokens} output tokens > context {ec.max_context}"
        return row
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1000 * batch + prompt)
    rids = [f"b{batch}-p{prompt}-{i}" for i in range(batch)]
    new = dict.fromkeys(rids, 0)
    allocs0 = engine.stats().device_allocs_since_warmup
    try:
        for rid in rids:
            engine.add_request(rid, torch.randint(0, engine.model_config.vocab_size, (prompt,),
                                                  generator=gen).tolist(), sp)
        t0 = time.perf_counter()
        prefill_steps = 0
        while min(new.values()) == 0:
            if time.time() > stop_at:
                raise _DeadlinePassed
            _count(engine.step(), new)
            prefill_steps += 1
        _sync(cuda)
        prefill_s = time.perf_counter() - t0
        row.update(prefill_s=prefill_s, prefill_steps=prefill_steps,
                   prefill_tokens_per_s=batch * prompt / prefill_s)
        for _ in range(args.warm_steps):
            _count(engine.step(), new)
        row["context_at_start"] = [prompt + min(new.values()), prompt + max(new.values())]
        _sync(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats(ec.torch_device)
        per_step: list[float] = []
        tokens = finished = 0
        t_start = time.perf_counter()
        for _ in range(args.steps):
            t = time.perf_counter()
            n, f = _count(engine.step(), new)
            per_step.append(time.perf_counter() - t)
            tokens, finished = tokens + n, finished + f
        _sync(cuda)
        seconds = time.perf_counter() - t_start
        if tokens != batch * args.steps or finished:
            row["error"] = (f"timed steps made {tokens} tokens (expected {batch * args.steps}), "
                            f"{finished} request(s) finished")
        row.update(
            seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds,
            ms_per_step=seconds / args.steps * 1e3,
            ms_per_step_median=statistics.median(per_step) * 1e3,
            ms_per_step_max=max(per_step) * 1e3,
            decode_peak_bytes=torch.cuda.max_memory_allocated(ec.torch_device) if cuda else None,
        )
    except torch.OutOfMemoryError as e:
        row["error"] = f"out of memory: {str(e).splitlines()[0]}"
    except EngineError as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    except _DeadlinePassed:
        row["error"] = "deadline passed during the prefill"
    finally:
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    allocs = engine.stats().device_allocs_since_warmup
    row["device_allocs_since_warmup"] = allocs
    row["device_allocs_row"] = None if allocs is None else allocs - (allocs0 or 0)
    return row
