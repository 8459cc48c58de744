"""How many kernels one DeepSeek-V4 decode step launches, with the fused decode loop and with
the unfused one, counted on the CPU through the Triton interpreter: a toy V4 with V4-Flash's
layer structure and FP8/MXFP4 weights, every kernel backend on, two sequences prefilled and
then one decode step of both, whose PyTorch ops that launch work (by source,
:class:`.kernel_sources.OpSources`) and Triton launches are counted. A count of launches, not of
time (on the GPU: :mod:`.profile_decode`); per-step work (rope tables, shared addressing, the
final head) is spread over the layers, so deeper models show fewer per layer.

    TRITON_INTERPRET=1 python -m bench.deepseek_v4.count_launches --layers SCHC

Never used by the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import Counter

import torch

from bench.deepseek_v4.context import flash_config
from bench.deepseek_v4.kernel_sources import OpSources
from bench.deepseek_v4.quantized_weights import synthetic_quantized_state_dict
from engine.models.deepseek_v4 import DeepseekV4KVPool, DeepseekV4Model, V4Backend


def count(layers: str, decode: str, prompts: tuple[int, int] = (30, 21)) -> tuple[Counter, Counter]:
    """(PyTorch ops by source, Triton launches by kernel) of one decode step of two sequences."""
    import triton.runtime.interpreter as interp

    cfg = flash_config(layers, 8, 256, tiny=True)
    cfg = dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32)  # MXFP4: x32 widths
    sd = synthetic_quantized_state_dict(cfg, "cpu", torch.float32)
    model = DeepseekV4Model.from_state_dict(cfg, sd, torch.float32, "cpu",
                                            V4Backend("kernels", "kernels", "kernels", decode=decode))
    cache = DeepseekV4KVPool.for_slots(cfg, 2, 64, torch.float32, "cpu")
    ids = torch.randint(2, cfg.vocab_size, (max(prompts),), generator=torch.Generator().manual_seed(0))
    for slot, n in enumerate(prompts):
        model(ids[:n], torch.arange(n), [0, n], [slot], cache)
    launches: Counter[str] = Counter()
    run = interp.InterpretedFunction.run

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launches[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    interp.InterpretedFunction.run = counted  # type: ignore[method-assign]
    sources = OpSources()
    try:
        with sources:
            model(torch.tensor([5, 6]), torch.tensor(list(prompts)), [0, 1, 2], [0, 1], cache)
    finally:
        interp.InterpretedFunction.run = run  # type: ignore[method-assign]
    # the interpreter's own tensor traffic is attributed to the launchers: not device work
    ops = Counter({k: v for k, v in sources.counts.items() if "_triton.py" not in k})
    return ops, launches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.deepseek_v4.count_launches")
    p.add_argument("--layers", default="SCHC", help="S sliding, C CSA, H HCA (V4-Flash's letters)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (before triton is imported)", file=sys.stderr)
        return 2
    n = len(args.layers)
    for decode in ("unfused", "fused"):
        ops, launches = count(args.layers, decode)
        total = sum(ops.values()) + sum(launches.values())
        print(f"[launches] {decode}: {total} a step, {total / n:.1f} a layer ({n} layers): "
              f"{sum(ops.values())} PyTorch ops, {sum(launches.values())} Triton launches")
        print("  PyTorch ops by source: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))
        print("  Triton: " + ", ".join(f"{k} {v}" for k, v in launches.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
