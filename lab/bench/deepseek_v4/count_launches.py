"""How many kernels one DeepSeek-V4 step launches, counted on the CPU through the Triton
interpreter: a toy V4 with V4-Flash's layer structure and FP8/MXFP4 weights, every kernel backend
on, the engine's locked Workspace bound as serving binds it. ``--step decode`` (default): two
sequences prefilled, then one decode step of both, with the fused decode loop and with the
unfused one. ``--step mixed``: what the scheduler runs under load,
one step of two prefill chunks of odd lengths (one continuing, one fresh) among ``--decodes``
decode tokens (3 by default). The step's PyTorch ops that launch work (by source,
:class:`.kernel_sources.OpSources`) and Triton launches are counted. A count of launches, not of
time (on the GPU: :mod:`.profile_decode`); per-step work (rope tables, shared addressing, the
final head) is spread over the layers, so deeper models show fewer per layer.

    TRITON_INTERPRET=1 python -m lab.bench.deepseek_v4.count_launches --layers SCHC \
        [--step mixed --decodes 3] [--record launches.json]

Never used by the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import Counter

import torch

from engine.models.deepseek_v4 import DeepseekV4KVPool, DeepseekV4Model, V4Backend
from engine.models.deepseek_v4.layers.merged_groups import unmerge_projections
from engine.models.deepseek_v4.memory.sizing import deepseek_v4_workspace_bytes
from engine.workspace import Workspace
from lab.bench.deepseek_v4.context import flash_config
from lab.bench.deepseek_v4.kernel_sources import OpSources
from lab.bench.deepseek_v4.quantized_weights import (
    reblock_fp8_scales,
    synthetic_quantized_state_dict,
)


def mixed_step(num_decodes: int) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """(prompt lengths by slot, (slot, tokens) of the step in row order) of a mixed step: slots
    ``0..num_decodes-1`` decode one token after prompts of odd lengths, the next slot continues
    its 9-token prompt with 13 tokens, a fresh slot takes an 11-token chunk (the chunks cross
    CSA windows and the 16-token blocks). Rows interleaved: decode, chunk, decode, chunk, the
    other decodes."""
    prompts = tuple(17 + (7 * i) % 23 for i in range(num_decodes)) + (9,)
    chunks = [(num_decodes, 13), (num_decodes + 1, 11)]
    decodes = [(s, 1) for s in range(num_decodes)]
    return prompts, decodes[:1] + chunks[:1] + decodes[1:2] + chunks[1:] + decodes[2:]


def count(layers: str, decode: str, prompts: tuple[int, ...] = (30, 21),
          step: str = "decode", num_decodes: int = 3, fp8_block: int = 16,
          merge: bool = True) -> tuple[Counter, Counter]:
    """(PyTorch ops by source, Triton launches by kernel) of one step: a decode step of two
    sequences, or (``step="mixed"``) :func:`mixed_step` with ``num_decodes`` decode tokens.
    ``fp8_block``: the FP8 scale block of the toy's linears (16: its widths are whole blocks,
    as V4-Flash's are of 128, so the projections merge as they do there; 128: they cannot).
    ``merge`` False: the merged projections run one by one again (layers/merged_groups.py)."""
    import triton.runtime.interpreter as interp

    cfg = flash_config(layers, 8, 256, tiny=True)
    # MXFP4: x32 widths; q_a / kv two 16-row FP8 scale blocks (a one-row grid reads as a
    # 128 block, which the toy's widths cannot merge on)
    cfg = dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32, q_lora_rank=32,
                              head_dim=32)
    sd = reblock_fp8_scales(synthetic_quantized_state_dict(cfg, "cpu", torch.float32), fp8_block)
    model = DeepseekV4Model.from_state_dict(cfg, sd, torch.float32, "cpu",
                                            V4Backend("kernels", "kernels", "kernels", decode=decode))
    if not merge:
        unmerge_projections(model)
    spans: list[tuple[int, int]] = []
    if step == "mixed":
        prompts, spans = mixed_step(num_decodes)
    cache = DeepseekV4KVPool.for_slots(cfg, len(prompts) + (step == "mixed"), 64, torch.float32, "cpu")
    ids = torch.randint(2, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    # the engine's locked Workspace: with it bound the steps are the engine's (the FP8 GEMVs'
    # split-K counters, which the fused decode's router shares; the fused MoE's scratch)
    ws = Workspace(deepseek_v4_workspace_bytes(cfg, 64, 64, mxfp4_experts=True,
                                               dtype=torch.float32), "cpu")
    ws.lock()
    for slot, n in enumerate(prompts):
        with ws.scope():
            model(ids[:n], torch.arange(n), [0, n], [slot], cache, ws=ws)
    if step == "mixed":
        pos = [torch.arange(cache.num_tokens[s], cache.num_tokens[s] + n) for s, n in spans]
        qsl = [0]
        for _, n in spans:
            qsl.append(qsl[-1] + n)
        args = (ids[: qsl[-1]], torch.cat(pos), qsl, [s for s, _ in spans], cache)
    else:
        args = (torch.tensor([5, 6]), torch.tensor(list(prompts)), [0, 1, 2], [0, 1], cache)
    launches: Counter[str] = Counter()
    run = interp.InterpretedFunction.run

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        launches[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    interp.InterpretedFunction.run = counted  # type: ignore[method-assign]
    sources = OpSources()
    try:
        with sources, ws.scope():
            model(*args, ws=ws)
    finally:
        interp.InterpretedFunction.run = run  # type: ignore[method-assign]
    # the interpreter's own tensor traffic is attributed to the launchers: not device work
    # (and so is a LaunchRecorder's, which wraps the launches: compile_check.py)
    ops = Counter({k: v for k, v in sources.counts.items()
                   if "_triton.py" not in k and "compile_check.py" not in k})
    return ops, launches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.count_launches")
    p.add_argument("--layers", default="SCHC", help="S sliding, C CSA, H HCA (V4-Flash's letters)")
    p.add_argument("--step", choices=("decode", "mixed"), default="decode",
                   help="a decode step of two sequences (fused and unfused loops), or a mixed "
                        "step of two prefill chunks and --decodes decode tokens")
    p.add_argument("--decodes", type=int, default=3, help="decode tokens of the mixed step")
    p.add_argument("--fp8-block", type=int, default=16,
                   help="FP8 scale block of the toy's linears (16: whole blocks, the projections "
                        "merge as at V4-Flash's shapes; 128: they cannot)")
    p.add_argument("--no-merge", action="store_true",
                   help="run the merged projections one by one (layers/merged_groups.py)")
    p.add_argument("--record", help="also write every distinct launch (prefills included) here "
                                    "for `python -m kernels.compile_check --records FILE`")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (before triton is imported)", file=sys.stderr)
        return 2
    from kernels.compile_check import LaunchRecorder

    n = len(args.layers)
    recorder = LaunchRecorder()
    for decode in ("unfused", "fused"):
        with recorder:
            ops, launches = count(args.layers, decode, step=args.step, num_decodes=args.decodes,
                                  fp8_block=args.fp8_block, merge=not args.no_merge)
        if args.step == "mixed":  # the decode loop's choice also picks the decode rows' kernels
            decode = f"mixed_{decode}"
        total = sum(ops.values()) + sum(launches.values())
        print(f"[launches] {decode}: {total} a step, {total / n:.1f} a layer ({n} layers): "
              f"{sum(ops.values())} PyTorch ops, {sum(launches.values())} Triton launches")
        print("  PyTorch ops by source: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))
        print("  Triton: " + ", ".join(f"{k} {v}" for k, v in launches.most_common()))
    if args.record:
        recorder.dump(args.record)
        print(f"[launches] {len(recorder.records)} distinct launches written to {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
