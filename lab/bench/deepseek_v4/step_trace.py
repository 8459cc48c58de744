"""The live tensor bytes of a DeepSeek-V4 warm-up on the CUDA code path, measured on a CPU.

    python -m lab.bench.deepseek_v4.step_trace --chunk 4096 --batch 1 --context 32768

builds the engine of tests/engine/deepseek_v4/test_plan_tightness.py (V4-Flash's layer
dimensions, FP8 / MXFP4 weights, ``--layers`` x ``--experts``) on the CPU, with every choice the
CUDA engine makes: the Triton attention, indexer, mHC, FP8 GEMMs and fused MoE
(``V4Backend()`` as CUDA resolves it), bf16, the kernels' plan terms. Each Triton
launch is skipped (``InterpretedFunction.run`` only zeroes the integer arguments, some of which
are indices PyTorch reads next): a kernel writes only into
buffers its wrapper allocated or took from the Workspace, so the allocations are those of the
GPU run while the values are not; the LM head's product is skipped likewise (its temporary is
still made). :class:`lab.bench.live_bytes.LiveBytes` counts the bytes alive through the warm-up,
the quantity the GPU engine reads as ``max_memory_allocated() - base`` (WarmupReport's
``activation_peak_bytes``), without the CUDA allocator's rounding (512 B a tensor, and up to
1 MiB where it hands out a cached block without splitting off the rest).

Prints the peak of each warm-up step, the tensors alive at the overall peak with the frames
that made them, and the plan's ``activations`` term. Never used by the engine; needs
TRITON_INTERPRET=1 on the CPU (set here on a machine without CUDA; the test tier sets it too).
``--device cuda`` runs the same count over the real kernels and prints the allocator's readings
beside it: both should agree with the CPU count, and where they do not, the listing says why.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# on the CPU the kernels' @triton.jit must build interpreter functions: before triton's import
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.models.deepseek_v4.backend import V4Backend  # noqa: E402
from engine.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from engine.models.deepseek_v4.model import DeepseekV4Model  # noqa: E402
from lab.bench.deepseek_v4.context import flash_config  # noqa: E402
from lab.bench.deepseek_v4.hf_config import hf_dict  # noqa: E402
from lab.bench.deepseek_v4.quantized_weights import (  # noqa: E402
    quantized_hf_config,
    synthetic_quantized_state_dict,
)
from lab.bench.live_bytes import Allocation, LiveBytes  # noqa: E402

# What the CUDA engine resolves V4Backend() to (backend.py; resolving needs no device)
CUDA_BACKEND = V4Backend().resolved(torch.device("cuda"))
# The CPU plan leaves out the Workspace terms of the CUDA-only fused MoE and FP8 GEMMs; the
# arena is made before the warm-up and is not counted, so a margin costs nothing measured.
_WS_MARGIN = 1 << 30


@dataclass(frozen=True)
class StepTrace:
    """One warm-up: the peak of each step (label -> bytes), the overall peak, the tensors alive
    then, and the plan's ``activations`` term."""

    step_peaks: dict[str, int]
    peak: int
    at_peak: list[Allocation]
    planned: int
    tracker: LiveBytes
    # CUDA only: the engine's own reading (max_memory_allocated - base) and the allocator's
    # memory_allocated - base at the moment of the counted peak; each equals ``peak`` (to the
    # allocator's rounding) unless memory that existed before the warm-up was freed during it
    allocator_peak: int | None = None
    allocated_at_peak: int | None = None


@contextlib.contextmanager
def cuda_code_path() -> Iterator[None]:
    """While open (with an engine config whose ``kernels`` are :data:`CUDA_BACKEND`, as
    :func:`engine_config` makes it): Triton launches do nothing, the LM head makes its temporary without the product, and the Workspace has a
    margin for the CUDA-only scratch the CPU plan does not count."""
    from triton.runtime.interpreter import InterpretedFunction

    import engine.model_runner as runner_mod
    saved = (InterpretedFunction.run, DeepseekV4Model.compute_logits, runner_mod.Workspace)
    base_ws = runner_mod.Workspace

    class _Workspace(base_ws):  # type: ignore[misc, valid-type]
        def __init__(self, capacity_bytes: int, device: Any) -> None:
            super().__init__(capacity_bytes + _WS_MARGIN, device)

    InterpretedFunction.run = _launch_nothing  # type: ignore[method-assign]
    DeepseekV4Model.compute_logits = _logits_shape_only  # type: ignore[method-assign]
    runner_mod.Workspace = _Workspace  # type: ignore[misc]
    try:
        yield
    finally:
        (InterpretedFunction.run, DeepseekV4Model.compute_logits,  # type: ignore[method-assign]
         runner_mod.Workspace) = saved


def _launch_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    """A skipped Triton launch. Its integer arguments are zeroed: some are outputs (row ids,
    entry slots) that PyTorch ops index with next, and 0 is a valid index where whatever the
    allocation held is not; the shapes of what follows do not depend on them."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64):
            a.zero_()


def _logits_shape_only(self: DeepseekV4Model, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``compute_logits`` with its allocations and no product (zeros: the sampler must not see
    NaN): a bf16 [n, vocab] temporary copied into the fp32 ``out``, as the real one makes."""
    w = self.lm_head.weight
    prod = hidden.new_zeros((hidden.shape[0], w.shape[0]), dtype=torch.result_type(hidden, w))
    if out is None:
        return prod
    if out.dtype == hidden.dtype == w.dtype and out.is_contiguous():
        return out.zero_()  # torch.mm(out=) makes no temporary
    return out.copy_(prod)


def engine_config(chunk: int, batch: int, context: int, block_size: int = 256,
                  num_blocks: int | None = None, kv_dtype: str = "auto",
                  device: str = "cpu") -> EngineConfig:
    """The EngineConfig lab.bench.deepseek_v4.decode.build_engine makes on CUDA (bf16; no graphs:
    they are captured after the measured pass), on ``device`` with the Triton attention's plan."""
    return EngineConfig(model="synthetic-v4-flash", device=device, dtype="bfloat16",
                        max_context=context, chunk_tokens=chunk, max_batch=batch,
                        strict_allocations=False, seed=0, cuda_graphs=False,
                        block_size=block_size, attn_tile_tokens=block_size,
                        num_blocks=num_blocks, kv_dtype=kv_dtype, attention_backend="triton",
                        kernels=CUDA_BACKEND)


def trace_warmup(cfg: DeepseekV4Config, ec: EngineConfig, stacks: bool = True) -> StepTrace:
    """Build the engine of ``cfg`` (FP8 / MXFP4 synthetic weights) under ``ec`` on the CUDA code
    path and measure the live bytes of its warm-up (on a CUDA ``ec``: the real kernels, and
    the allocator's readings beside the count)."""
    from engine.warmup import Warmup

    cuda = ec.torch_device.type == "cuda"
    dev = ec.torch_device
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("step_trace on the CPU needs TRITON_INTERPRET=1 set before triton is "
                           "imported")
    tracker = LiveBytes(stacks=stacks,
                        probe=(lambda: torch.cuda.memory_allocated(dev)) if cuda else None)
    step_peaks: dict[str, int] = {}
    base: list[int] = []
    run_steps, execute = Warmup.run_steps, Warmup.execute_step

    def run_traced(self: Any, steps: Any, *a: Any, **k: Any) -> None:
        if base:  # the CUDA-only second pass: not part of the measured peak
            return run_steps(self, steps, *a, **k)
        base.append(torch.cuda.memory_allocated(dev) if cuda else 0)
        with tracker:
            run_steps(self, steps, *a, **k)
        base.append(-1)  # done: later steps are not counted

    def execute_traced(self: Any, chunks: list[Any], *a: Any) -> None:
        if len(base) != 1:
            return execute(self, chunks, *a)
        label = (f"{len(chunks)} seq, {sum(c.num_tokens for c in chunks)} tokens to context "
                 f"{max(c.context_len for c in chunks)}")
        tracker.mark(label)
        overall = (tracker.peak, tracker.at_peak, tracker.peak_label, tracker.probe_at_peak)
        tracker.reset_peak()
        execute(self, chunks, *a)
        step_peaks[label] = tracker.peak
        if overall[0] >= tracker.peak:
            tracker.peak, tracker.at_peak, tracker.peak_label, tracker.probe_at_peak = overall

    hf = quantized_hf_config(hf_dict(cfg))
    weights = synthetic_quantized_state_dict(cfg, dev, ec.torch_dtype)
    Warmup.run_steps = run_traced  # type: ignore[method-assign]
    Warmup.execute_step = execute_traced  # type: ignore[method-assign]
    try:
        with contextlib.nullcontext() if cuda else cuda_code_path():
            engine = LLMEngine(ec, ModelConfig.from_hf_dict(hf, name=ec.model), weights)
    finally:
        Warmup.run_steps = run_steps  # type: ignore[method-assign]
        Warmup.execute_step = execute  # type: ignore[method-assign]
    planned = engine.plan.term("activations")
    rep = engine.warmup_report
    at_peak = None if tracker.probe_at_peak is None else tracker.probe_at_peak - base[0]
    return StepTrace(step_peaks, tracker.peak, tracker.at_peak, planned, tracker,
                     None if rep is None else rep.activation_peak_bytes, at_peak)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--layers", default="SCH")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks (default: the plan's)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--tiny", action="store_true", help="toy dimensions (a quick check)")
    p.add_argument("--top", type=int, default=40, help="tensors listed at the peak")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the real kernels, and the allocator's readings beside the count")
    args = p.parse_args(argv)
    cfg = flash_config(args.layers, args.experts, args.context, tiny=args.tiny)
    if args.tiny:  # MXFP4 needs widths in multiples of 32 (as lab.bench.deepseek_v4.decode does)
        import dataclasses

        cfg = dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32)
    torch.manual_seed(0)
    t = trace_warmup(cfg, engine_config(args.chunk, args.batch, args.context, args.block_size,
                                        args.num_blocks, args.kv_dtype, device=args.device))
    for label, peak in t.step_peaks.items():
        print(f"step {label}: peak {peak:,} B")
    print(t.tracker.report(args.top))
    if t.allocator_peak is not None:
        print(f"CUDA allocator: warm-up reading (max_memory_allocated - base) {t.allocator_peak:,}"
              f" B; memory_allocated - base at the counted peak {t.allocated_at_peak:,} B")
    print(f"measured {t.peak:,} B, planned {t.planned:,} B, ratio {t.peak / t.planned:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
