"""``python -m lab.bench.spec_decode``: n-gram speculative decoding on an agent-like workload,
against no speculation, in one run on the same weights.

The workload is what agent loops send: a tool's JSON result the assistant is asked to quote
back, and a function it is asked to restate with one change. Each engine is built from the
worker settings a user would pass (``WorkerSettings`` -> ``WorkerConfig`` -> ``LLMEngine``),
the default model unless ``--model``; both decode the same prompts greedily, one at a time
(``--batch 1``, the single stream an agent waits on) or together, the two arms' engine steps
interleaved one by one. Prints, per arm, the output tokens per second of the time its steps
took, the steps, and with speculation the acceptance rate (accepted / verified
draft tokens); compares both arms' tokens, and where they part reports the two best logits'
margin there (greedy speculation keeps the argmax of the verify forward's logits, which may
round differently from a one-position step's at a near-tie).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

TOOL_RESULT = json.dumps({
    "status": "ok", "order_id": "A-1042", "items": [
        {"sku": "KB-201", "name": "mechanical keyboard", "qty": 1, "price": 89.5},
        {"sku": "MS-330", "name": "wireless mouse", "qty": 2, "price": 24.0}],
    "shipping": {"carrier": "DHL", "eta_days": 3, "address": "12 Harbour Street, Leith"},
    "total": 137.5})
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
CHATS = [
    [{"role": "user", "content": "Look up order A-1042."},
     {"role": "assistant", "content": "Calling the orders tool."},
     {"role": "user", "content": f"Tool result:\n{TOOL_RESULT}\n\nQuote the tool result back "
                                 "to me exactly, as JSON."}],
    [{"role": "user", "content": f"Here is my function:\n\n{CODE}\nRewrite it with the "
                                 "parameter `window` renamed to `size`. Output only the code."}],
    [{"role": "user", "content": f"Shipping details from the tool:\n{TOOL_RESULT}\n\nRepeat "
                                 "the shipping object and the items list."}],
    [{"role": "user", "content": f"{CODE}\nAdd a docstring to this function and show the "
                                 "whole function."}],
]


def _engine(model: str, method: str, k: int, max_batch: int, max_context: int,
            dtype: str, device: str = "cpu") -> object:
    from common.settings import WorkerSettings
    from engine.llm_engine import LLMEngine
    from worker.worker_config import WorkerConfig

    settings = WorkerSettings(role="decode", model=model, device=device, max_context=max_context,
                              dtype=dtype,
                              max_batch=max_batch, speculative_method=method,
                              num_speculative_tokens=k)
    return LLMEngine.from_config(WorkerConfig.from_settings(settings).engine)


def _prompts(engine: object) -> list[list[int]]:
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_path(engine.config.model)  # type: ignore[attr-defined]
    return [tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True),
                       add_special_tokens=False) for chat in CHATS]


def _run_interleaved(arms: dict[str, object], prompts: dict[str, list[int]],
                     max_tokens: int) -> dict[str, tuple[dict[str, list[int]], float, list[float]]]:
    """Decode ``prompts`` on every arm at once, one engine step of each arm in turn, timing each
    step: the machine's other load falls on both arms alike (on a shared 2-core machine a run
    of the same step sequence varies tenfold, a step's neighbour in time much less).
    -> per arm: outputs, the summed seconds of its steps, each step's seconds."""
    from engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = {name: {rid: [] for rid in prompts} for name in arms}
    secs = dict.fromkeys(arms, 0.0)
    steps: dict[str, list[float]] = {name: [] for name in arms}
    for eng in arms.values():
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, sp)  # type: ignore[attr-defined]
    while any(eng.has_unfinished() for eng in arms.values()):  # type: ignore[attr-defined]
        for name, eng in arms.items():
            if not eng.has_unfinished():  # type: ignore[attr-defined]
                continue
            start = time.perf_counter()
            got = eng.step()  # type: ignore[attr-defined]
            took = time.perf_counter() - start
            secs[name] += took
            steps[name].append(took)
            for o in got:
                outs[name][o.request_id] += o.new_token_ids
    return {name: (outs[name], secs[name], steps[name]) for name in arms}


def _partings(arms: dict[str, object], prompts: list[list[int]],
              outputs: dict[str, dict[str, list[int]]]) -> list[dict]:
    """Where the arms' greedy outputs part, if anywhere: the first differing position and the
    margin between the two best logits there, scored by each engine on the common prefix (a
    margin near zero is a floating-point tie, which the verify forward's different matmul
    shape may break the other way)."""
    found = []
    for i, prompt in enumerate(prompts):
        a, b = outputs["none"][f"p{i}"], outputs["ngram"][f"p{i}"]
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
        entry: dict = dict(prompt=f"p{i}", position=at, none=a[at:at + 1], ngram=b[at:at + 1])
        for name, eng in arms.items():
            logits = eng.final_logits(prompt + a[:at], f"part-{name}-{i}")  # type: ignore[attr-defined]
            top = logits.topk(2).values
            entry[f"top2_margin_{name}"] = float(top[0] - top[1])
        found.append(entry)
        print(f"p{i}: the arms part at output token {at}: {entry}", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.spec_decode", description=__doc__)
    ap.add_argument("--model", default="", help="'' = the default model (SmolLM2-135M)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--dtype", default="auto", help="the worker's dtype setting (auto: bfloat16 "
                    "on the CPU)")
    ap.add_argument("--device", default="cpu", help="the worker's device setting (cpu, cuda)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not args.model:
        from common.default_model import default_model_path

        args.model = str(default_model_path())
    arms = {name: _engine(args.model, name, args.k, args.batch, args.max_context, args.dtype,
                          args.device)
            for name in ("none", "ngram")}
    prompts = _prompts(arms["none"])
    rows = {name: dict(arm=name, k=args.k if name == "ngram" else 0, batch=args.batch,
                       dtype=args.dtype, device=args.device,
                       prompts=len(prompts), max_tokens=args.max_tokens, tokens=0, wall_s=0.0,
                       steps=0, step_s=[], draft_tokens=0, accepted_tokens=0, verifies=0,
                       accepted_per_pos=[0] * args.k)
            for name in arms}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name in arms}
    for first in range(0, len(prompts), args.batch):
        group = {f"p{i}": prompts[i] for i in range(first, min(first + args.batch,
                                                                len(prompts)))}
        before = {name: eng.stats() for name, eng in arms.items()}  # type: ignore[attr-defined]
        runs = _run_interleaved(arms, group, args.max_tokens)
        for name, (out, wall, step_s) in runs.items():
            steps = len(step_s)
            after = arms[name].stats()  # type: ignore[attr-defined]
            row, was = rows[name], before[name]
            tokens = sum(len(v) for v in out.values())
            row["tokens"] += tokens
            row["wall_s"] = round(row["wall_s"] + wall, 3)
            row["steps"] += steps
            row["step_s"].extend(step_s)
            row["draft_tokens"] += after.spec_num_draft_tokens - was.spec_num_draft_tokens
            row["accepted_tokens"] += (after.spec_num_accepted_tokens
                                       - was.spec_num_accepted_tokens)
            row["verifies"] += after.spec_num_drafts - was.spec_num_drafts
            for i, (x, y) in enumerate(zip(after.spec_accepted_per_pos,
                                           was.spec_accepted_per_pos or
                                           (0,) * len(after.spec_accepted_per_pos),
                                           strict=True)):
                row["accepted_per_pos"][i] += x - y
            outputs[name].update(out)
            print(f"{list(group)} {name}: {tokens} tokens in {wall:.2f} s of its steps "
                  f"({tokens / wall:.2f} tok/s), {steps} steps", flush=True)
    identical = outputs["none"] == outputs["ngram"]
    partings = _partings(arms, prompts, outputs)
    for row in rows.values():
        row["partings"] = partings
    for row in rows.values():
        row["tok_per_s"] = round(row["tokens"] / row["wall_s"], 3)
        # a step stalled by the machine's other load (seconds, not milliseconds) weighs on the
        # sum; the median step is what the arm costs undisturbed
        row["median_step_ms"] = round(1e3 * statistics.median(row["step_s"]), 2)
        row["tok_per_s_at_median_step"] = round(
            row["tokens"] / (row["steps"] * statistics.median(row["step_s"])), 3)
        row["step_s"] = [round(t, 4) for t in row["step_s"]]
        row["acceptance_rate"] = (round(row["accepted_tokens"] / row["draft_tokens"], 3)
                                  if row["draft_tokens"] else None)
        row["identical_to_none"] = identical
    print(f"\n{'arm':<7}{'tokens':>7}{'steps':>7}{'tok/s':>8}{'med ms':>8}{'tok/s@med':>10}"
          f"{'drafts':>8}{'accepted':>9}{'rate':>7}")
    for r in rows.values():
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"{r['arm']:<7}{r['tokens']:>7}{r['steps']:>7}{r['tok_per_s']:>8.2f}"
              f"{r['median_step_ms']:>8.1f}{r['tok_per_s_at_median_step']:>10.2f}"
              f"{r['draft_tokens']:>8}{r['accepted_tokens']:>9}{rate:>7}")
    print(f"greedy outputs identical: {identical}; speed-up "
          f"{rows['ngram']['tok_per_s'] / rows['none']['tok_per_s']:.2f}x (summed steps), "
          f"{rows['ngram']['tok_per_s_at_median_step'] / rows['none']['tok_per_s_at_median_step']:.2f}x"
          " (median step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(list(rows.values()), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
