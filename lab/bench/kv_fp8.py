"""``python -m lab.bench.kv_fp8``: what kv_dtype=fp8 buys a dense model on a CUDA device: KV tokens
per GiB of the plan and decode tokens/s at a long context, kv_dtype auto then fp8, on the same
random weights (shapes only; lab.bench.engine's builders) in the same run.

Each engine is built from EngineConfig as a worker builds it (CUDA graphs, Triton attention and
the fused kernels on), runs strict about device allocations after warm-up, and is dropped before
the next is built. Prints one row per kv dtype and, with --json, writes them.
"""

from __future__ import annotations

import argparse

import torch

from lab.bench.engine import _decode_tps, _engine, _hf_model
from lab.bench.results_file import write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.kv_fp8", description=__doc__)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = _hf_model(args.shape)
    rows = []
    for kv_dtype in ("auto", "fp8"):
        eng = _engine(model, max_context=args.context + args.steps + 16, chunk_tokens=8192,
                      max_batch=args.batch, kv_dtype=kv_dtype)
        tps = _decode_tps(eng, args.batch, args.context, args.steps)
        rows.append(dict(shape=args.shape, kv_dtype=kv_dtype, batch=args.batch,
                         context=args.context, decode_tokens_per_s=tps,
                         step_ms=1e3 * args.batch / tps,
                         kv_bytes_per_token=eng.kv_layout.bytes_per_token,
                         kv_cache_bytes=eng.plan.term("kv_cache"),
                         kv_tokens_per_gib=eng.plan.kv_tokens_per_gib,
                         graph_steps=eng.runner.num_graph_steps,
                         allocs_after_warmup=eng.stats().device_allocs_since_warmup))
        print(rows[-1], flush=True)
        del eng
        torch.cuda.empty_cache()  # between engines only: no engine is serving here
    print(f"\n{'kv_dtype':<9}{'B/token':>10}{'tokens/GiB':>12}{'step ms':>9}{'tok/s':>9}"
          f"{'allocs':>7}")
    for r in rows:
        print(f"{r['kv_dtype']:<9}{r['kv_bytes_per_token']:>10,.0f}{r['kv_tokens_per_gib']:>12,.0f}"
              f"{r['step_ms']:>9.2f}{r['decode_tokens_per_s']:>9.0f}{r['allocs_after_warmup']!s:>7}")
    write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
