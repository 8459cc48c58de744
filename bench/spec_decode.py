"""``python -m bench.spec_decode``: n-gram speculative decoding on an agent-like workload,
against no speculation, in one run on the same weights.

The workload is what agent loops send: a tool's JSON result the assistant is asked to quote
back, and a function it is asked to restate with one change. Each engine is built from the
worker settings a user would pass (``WorkerSettings`` -> ``WorkerConfig`` -> ``LLMEngine``),
the default model unless ``--model``; both decode the same prompts greedily, one at a time
(``--batch 1``, the single stream an agent waits on) or together. Prints, per arm, the output
tokens per second of wall time, the steps, and with speculation the acceptance rate
(accepted / verified draft tokens) and tokens per verify; checks that both arms gave the same
tokens (greedy speculation is exact).
"""

from __future__ import annotations

import argparse
import json
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


def _engine(model: str, method: str, k: int, max_batch: int) -> object:
    from common.settings import WorkerSettings
    from engine.llm_engine import LLMEngine
    from worker.worker_config import WorkerConfig

    settings = WorkerSettings(role="decode", model=model, device="cpu", max_context=2048,
                              max_batch=max_batch, speculative_method=method,
                              num_speculative_tokens=k)
    return LLMEngine.from_config(WorkerConfig.from_settings(settings).engine)


def _prompts(engine: object) -> list[list[int]]:
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_path(engine.config.model)  # type: ignore[attr-defined]
    return [tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True),
                       add_special_tokens=False) for chat in CHATS]


def _run(engine: object, prompts: list[list[int]], max_tokens: int,
         batch: int) -> tuple[dict[str, list[int]], float, int]:
    from engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out: dict[str, list[int]] = {}
    steps0 = engine.stats().steps_completed  # type: ignore[attr-defined]
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        for i in range(first, min(first + batch, len(prompts))):
            engine.add_request(f"p{i}", prompts[i], sp)  # type: ignore[attr-defined]
            out[f"p{i}"] = []
        while engine.has_unfinished():  # type: ignore[attr-defined]
            for o in engine.step():  # type: ignore[attr-defined]
                out[o.request_id] += o.new_token_ids
    wall = time.perf_counter() - start
    return out, wall, engine.stats().steps_completed - steps0  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__)
    ap.add_argument("--model", default="", help="'' = the default model (SmolLM2-135M)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not args.model:
        from common.default_model import default_model_path

        args.model = str(default_model_path())
    arms = {"none": _engine(args.model, "none", args.k, args.batch),
            "ngram": _engine(args.model, "ngram", args.k, args.batch)}
    prompts = _prompts(arms["none"])
    rows: dict[str, dict] = {}
    outputs: dict[str, dict[str, list[int]]] = {}
    for rep in range(args.repeats):  # alternate the arms: the machine's load hits both alike
        for name, eng in arms.items():
            before = eng.stats()  # type: ignore[attr-defined]
            out, wall, steps = _run(eng, prompts, args.max_tokens, args.batch)
            after = eng.stats()  # type: ignore[attr-defined]
            tokens = sum(len(v) for v in out.values())
            row = rows.setdefault(name, dict(arm=name, k=args.k if name == "ngram" else 0,
                                             batch=args.batch, prompts=len(prompts),
                                             tokens=tokens, wall_s=[], steps=steps,
                                             draft_tokens=0, accepted_tokens=0, verifies=0))
            row["wall_s"].append(round(wall, 3))
            row["draft_tokens"] = after.spec_num_draft_tokens - before.spec_num_draft_tokens
            row["accepted_tokens"] = (after.spec_num_accepted_tokens
                                      - before.spec_num_accepted_tokens)
            row["verifies"] = after.spec_num_drafts - before.spec_num_drafts
            row["accepted_per_pos"] = [a - b for a, b in zip(
                after.spec_accepted_per_pos, before.spec_accepted_per_pos or
                (0,) * len(after.spec_accepted_per_pos), strict=True)]
            outputs[name] = out
            print(f"run {rep + 1} {name}: {tokens} tokens in {wall:.2f} s "
                  f"({tokens / wall:.1f} tok/s), {steps} steps", flush=True)
    identical = outputs["none"] == outputs["ngram"]
    for row in rows.values():
        row["tok_per_s_best"] = round(row["tokens"] / min(row["wall_s"]), 2)
        row["acceptance_rate"] = (round(row["accepted_tokens"] / row["draft_tokens"], 3)
                                  if row["draft_tokens"] else None)
        row["identical_to_none"] = identical
    print(f"\n{'arm':<7}{'tokens':>7}{'steps':>7}{'tok/s':>8}{'drafts':>8}{'accepted':>9}"
          f"{'rate':>7}")
    for r in rows.values():
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"{r['arm']:<7}{r['tokens']:>7}{r['steps']:>7}{r['tok_per_s_best']:>8.1f}"
              f"{r['draft_tokens']:>8}{r['accepted_tokens']:>9}{rate:>7}")
    print(f"greedy outputs identical: {identical}; speed-up "
          f"{rows['ngram']['tok_per_s_best'] / rows['none']['tok_per_s_best']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(list(rows.values()), f, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
