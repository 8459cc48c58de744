"""``python -m lab.bench.engine``: engine decode and prefill figures on a CUDA device, beside
transformers ``generate`` on the same weights in the same run. Random weights (shapes only).

Prints one table and, with --json, writes the figures. Also reports device allocations after
warm-up over the whole run (must be 0) and whether decode steps ran as CUDA graphs.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.synthetic_model import SHAPES as _SYNTHETIC
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scoring import greedy_batch
from lab.bench.results_file import write_json

# the engine benches build weights in memory; SmolLM2 ties its head to the embedding
SHAPES = {"llama3-8b": _SYNTHETIC["llama3-8b"],
          "smollm2-135m": {**_SYNTHETIC["smollm2-135m"], "tie_word_embeddings": True}}


def _hf_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def _engine(model, **kw) -> LLMEngine:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    weights = dict(model.state_dict())
    ec = EngineConfig(model="bench", device="cuda", dtype="bfloat16", strict_allocations=True, **kw)
    return LLMEngine(ec, cfg, weights)


def _decode_tps(engine: LLMEngine, batch: int, prompt: int, steps: int) -> float:
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    # prefill (and a couple of decode steps) untimed
    for _ in range(-(-batch * prompt // engine.config.chunk_tokens) + 2):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    return batch * steps / dt


def _hf_decode_tps(model, batch: int, prompt: int, steps: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t)


def _greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = greedy_batch(engine, prompts, new, prefix="agree-")
    return [out[f"agree-{i}"] for i in range(len(prompts))]


def _hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _agreement(model, engine: LLMEngine, num: int = 4, prompt: int = 40, new: int = 24) -> dict:
    """Greedy tokens of the fast path (graphs + fused kernels) against the same engine stepping
    eagerly and against transformers: how many sequences match exactly, and the shortest common
    prefix (bf16 on random weights: near-tied logits can flip late tokens)."""
    g = torch.Generator().manual_seed(5)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt + 3 * i,), generator=g).tolist()
               for i in range(num)]
    fast = _greedy(engine, prompts, new)
    eager_engine = _engine(model, max_context=512, chunk_tokens=4096, max_batch=num,
                           cuda_graphs=False)
    eager = _greedy(eager_engine, prompts, new)
    del eager_engine
    hf = _hf_greedy(model, prompts, new)

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))

    return dict(sequences=num, new_tokens=new,
                fast_eq_eager=sum(a == b for a, b in zip(fast, eager, strict=True)),
                fast_eq_hf=sum(a == b for a, b in zip(fast, hf, strict=True)),
                min_common_prefix_hf=min(common(a, b) for a, b in zip(fast, hf, strict=True)))


def _time_to_first_token(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    """Seconds from queuing ``prompt`` alone to its first token."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _first_steps(engine: LLMEngine, lengths: list[int]) -> list[float]:
    """Seconds to the first token of a fresh request of each length, one at a time, after the
    warm-up: lengths the warm-up never ran must not pay a kernel compilation here."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(2)
    return [_time_to_first_token(engine, f"first-{n}",
                                 torch.randint(0, vocab, (n,), generator=g).tolist())
            for n in lengths]


def _prefill(engine: LLMEngine, n: int) -> tuple[float, float]:
    vocab = engine.model_config.vocab_size
    prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    ttft = _time_to_first_token(engine, f"p{n}", prompt)
    return n / ttft, ttft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.engine", description=__doc__)
    ap.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prefill", default="4096,32768,131072")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--no-agreement", action="store_true",
                    help="skip the greedy-token check (fast path vs eager vs transformers)")
    ap.add_argument("--bandwidth", type=float, default=4.3,
                    help="device memory bandwidth in TB/s for the weight-streaming limit")
    ap.add_argument("--first-steps", default="83,301,457,3",
                    help="prompt lengths whose time to first token is reported right after the "
                         "warm-up (a Triton compile would show here); '' to skip")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        model = _hf_model(shape)
        batches = [int(b) for b in args.batches.split(",")]
        eng = _engine(model, max_context=512, chunk_tokens=4096, max_batch=max(batches))
        weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        lengths = [int(x) for x in args.first_steps.split(",") if x]
        if lengths:
            secs = _first_steps(eng, lengths)
            rows.append(dict(shape=shape, kind="first-steps", tokens_per_s=0.0,
                             lengths=lengths, seconds=secs,
                             allocs_after_warmup=eng.stats().device_allocs_since_warmup))
            print(rows[-1], flush=True)
        # The engine's rows first, transformers after: the allocation counter is per process,
        # and transformers' own cudaMallocs must not be charged to the engine.
        decode_rows = []
        for b in batches:
            tps = _decode_tps(eng, b, 128, args.steps)
            # batch 1 reads every weight once a step: the step rate the bandwidth allows
            limit = args.bandwidth * 1e12 / weight_bytes
            decode_rows.append(dict(shape=shape, kind="decode", batch=b, tokens_per_s=tps,
                                    hf_tokens_per_s=None, graph_steps=eng.runner.num_graph_steps,
                                    steps_per_s=tps / b, weight_stream_limit_steps_per_s=limit,
                                    pct_of_limit=100 * tps / b / limit,
                                    allocs_after_warmup=eng.stats().device_allocs_since_warmup))
            print(decode_rows[-1], flush=True)
        agree = None if args.no_agreement else _agreement(model, eng)
        del eng
        torch.cuda.empty_cache()  # between engines only: no engine is serving here
        for r in decode_rows:
            if not args.no_hf:
                r["hf_tokens_per_s"] = _hf_decode_tps(model, r["batch"], 128, args.steps)
                print(f"transformers batch {r['batch']}: {r['hf_tokens_per_s']:.1f} tok/s",
                      flush=True)
            rows.append(r)
        if agree is not None:
            rows.append(dict(shape=shape, kind="agreement", tokens_per_s=0.0, **agree,
                             allocs_after_warmup=decode_rows[-1]["allocs_after_warmup"]))
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
        lens = [int(x) for x in args.prefill.split(",")]
        peng = _engine(model, max_context=max(lens) + 8, chunk_tokens=4096, max_batch=1,
                       cuda_graphs=False)
        for n in lens:
            tps, ttft = _prefill(peng, n)
            rows.append(dict(shape=shape, kind="prefill", prompt=n, tokens_per_s=tps, ttft_s=ttft,
                             allocs_after_warmup=peng.stats().device_allocs_since_warmup))
            print(rows[-1], flush=True)
        del peng, model
        torch.cuda.empty_cache()
    print(f"\n{'shape':<14}{'kind':<9}{'batch/prompt':>13}{'tok/s':>12}{'hf tok/s':>10}"
          f"{'TTFT s':>8}{'allocs':>7}{'% BW limit':>11}")
    for r in rows:
        if r["kind"] == "first-steps":
            times = ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in zip(r["lengths"], r["seconds"],
                                                                      strict=True))
            print(f"{r['shape']:<14}first token right after warm-up: {times}")
            continue
        if r["kind"] == "agreement":
            print(f"{r['shape']:<14}greedy tokens, {r['sequences']} sequences x "
                  f"{r['new_tokens']}: fast==eager {r['fast_eq_eager']}, fast==transformers "
                  f"{r['fast_eq_hf']} (shortest common prefix {r['min_common_prefix_hf']})")
            continue
        size = r.get("batch") or r.get("prompt")
        hf = r.get("hf_tokens_per_s")
        pct = f"{r['pct_of_limit']:.0f}%" if "pct_of_limit" in r else "-"
        print(f"{r['shape']:<14}{r['kind']:<9}{size:>13}{r['tokens_per_s']:>12.1f}"
              f"{(f'{hf:.1f}' if hf else '-'):>10}{r.get('ttft_s', float('nan')):>8.3f}"
              f"{r['allocs_after_warmup']!s:>7}"
              f"{pct:>11}")
    write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
