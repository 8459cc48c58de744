"""DeepSeek-V4 layers that hold their weights in checkpoint format: block-scaled FP8 linears
(plain and block-diagonal) and MXFP4 routed experts.

They replace ``nn.Linear`` / ``GroupedLinear`` / the bf16 experts where the checkpoint's payload
is quantized (:func:`.swap_quantized.swap_quantized_modules`, on the meta device, before anything is
allocated). ``use_kernels`` picks the kernels package's Triton GEMMs (CUDA, or the interpreter)
or their PyTorch references (the CPU tier). Output buffers are activations of the step, like
``F.linear``'s; the experts' scratch comes from the engine's Workspace when one is given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.fp8_linear import (
    fp8_grouped_linear,
    fp8_linear,
    fp8_linear_scratch_bytes,
    gemv_semaphores,
)
from kernels.fp8_linear_ref import fp8_grouped_linear_ref, fp8_linear_ref
from kernels.fp8_w8a8 import (
    fp8_grouped_linear_w8a8,
    fp8_linear_w8a8,
    fp8_w8a8_scratch_bytes,
    uses_w8a8,
)
from kernels.moe_sort_sizes import PREFILL_MIN_PAIRS
from kernels.mxfp4_moe import moe_experts, moe_experts_workspace_bytes, uses_fp8
from kernels.mxfp4_moe_ref import moe_experts_ref


class Fp8Linear(nn.Module):
    """``y = x @ dequant(weight)^T``: weight e4m3 ``[out, in]`` (``groups`` > 1: block-diagonal,
    ``[groups * out/groups, in/groups]``, x ``[N, groups, in/groups]``), scale fp32 grid.
    With kernels, ``W8A8_MIN_ROWS`` rows or more (a prefill chunk) and a bound Workspace
    (:func:`bind_workspace`), the activations are quantized to e4m3 per 1 x 128 group and the
    product is FP8 x FP8 (``kernels.fp8_w8a8``) when ``w8a8`` is set: the default, as in
    DeepSeek's own inference code, which quantizes activations per 1 x 128 for its FP8 GEMMs. On
    the H200 it made a full-depth 4096-token chunk 10% faster (lab/results/notebook.md, 2026-12-04);
    :func:`set_prefill_fp8` turns it off (benchmarks compare both). A decode GEMV variant that
    splits K (``kernels.fp8_linear.fp8_gemv_variant``) takes its partials from the bound
    Workspace too, and sums them in its own launch through the model's split-K counters
    (``semaphores``, bound with the Workspace)."""

    def __init__(self, weight_shape: tuple[int, int], groups: int = 1) -> None:
        super().__init__()
        self.groups = groups
        self.block = (128, 128)
        self.use_kernels = False
        self.w8a8 = True
        self.workspace: object | None = None
        self.semaphores: torch.Tensor | None = None
        self.register_buffer("weight", torch.empty(weight_shape, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.empty(0, 0, dtype=torch.float32))

    def _takes_w8a8(self, rows: int) -> bool:
        return (self.w8a8 and self.workspace is not None
                and uses_w8a8(rows, self.block, self.weight.shape[0] // self.groups))

    def _w8a8(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [N, G, K] -> out [N, G * N_g] through the w8a8 kernels, scratch from the Workspace."""
        m, groups, k = x.shape
        ws = self.workspace
        with ws.scope():  # type: ignore[attr-defined]
            scratch = ws.take((fp8_w8a8_scratch_bytes(m, k, groups),), torch.uint8,  # type: ignore[attr-defined]
                              caller="deepseek_v4.fp8_act_quant")
            if groups > 1:
                return fp8_grouped_linear_w8a8(x, self.weight, self.scale, out, scratch, self.block)
            return fp8_linear_w8a8(x[:, 0], self.weight, self.scale, out, scratch, self.block)

    def _weight_only(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x [N, G, K] -> out [N, G * N_g] through the weight-only kernels; a decode variant
        that splits K takes its fp32 partials from the Workspace (none by default)."""
        m, groups, k = x.shape
        need = fp8_linear_scratch_bytes(m, self.weight.shape[0], k, self.block)
        ws = self.workspace
        if not need or ws is None:
            if groups > 1:
                return fp8_grouped_linear(x, self.weight, self.scale, out, self.block)
            return fp8_linear(x[:, 0], self.weight, self.scale, out, self.block)
        with ws.scope():  # type: ignore[attr-defined]
            scratch = ws.take((need,), torch.uint8, caller="deepseek_v4.fp8_gemv_split")  # type: ignore[attr-defined]
            if groups > 1:
                return fp8_grouped_linear(x, self.weight, self.scale, out, self.block,
                                          workspace=scratch, semaphores=self.semaphores)
            return fp8_linear(x[:, 0], self.weight, self.scale, out, self.block, workspace=scratch,
                              semaphores=self.semaphores)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: where the result goes (plain, not block-diagonal; the shape of the result),
        e.g. a buffer another stream reads; else a new tensor."""
        if self.groups > 1:
            assert out is None, "Fp8Linear: out= is for the plain form"
            # x: [N, G, in/G] -> [N, out]
            if not self.use_kernels:
                return fp8_grouped_linear_ref(x, self.weight, self.scale, self.block)
            out = torch.empty(x.shape[0], self.weight.shape[0], dtype=x.dtype, device=x.device)
            if self._takes_w8a8(x.shape[0]):
                return self._w8a8(x, out)
            return self._weight_only(x, out)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        n = self.weight.shape[0]
        if not self.use_kernels:
            y = fp8_linear_ref(x2, self.weight, self.scale, self.block).view(*lead, -1)
            return y if out is None else out.copy_(y)
        dst = (torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device) if out is None
               else out.view(x2.shape[0], n))
        if self._takes_w8a8(x2.shape[0]):
            return self._w8a8(x2.unsqueeze(1), dst).view(*lead, -1)
        return self._weight_only(x2.unsqueeze(1), dst).view(*lead, -1)


def bind_workspace(model: nn.Module, ws: object | None) -> None:
    """Hands the engine's Workspace to every FP8 linear of ``model`` (their prefill path takes
    its activation scratch from it, a split-K decode GEMV its partials), and with it the
    model's split-K counters (``kernels.fp8_linear.gemv_semaphores``, 16 KiB made at the first
    bind: the warm-up; the plan's ``fp8_gemv_semaphores``), and a second set for the decode
    step's side lane (:func:`side_semaphores`); nothing to do when this one is bound already."""
    if model.__dict__.get("_fp8_workspace") is ws:
        return
    sem = model.__dict__.get("_fp8_semaphores")
    if ws is not None and sem is None:
        lins = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        if lins:
            sem = model.__dict__["_fp8_semaphores"] = gemv_semaphores(lins[0].weight.device)
            model.__dict__["_fp8_side_semaphores"] = gemv_semaphores(lins[0].weight.device)
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod.workspace = ws
            mod.semaphores = sem if ws is not None else None
    model.__dict__["_fp8_workspace"] = ws


def side_semaphores(model: nn.Module) -> torch.Tensor | None:
    """The split-K counters of work on the decode step's side lane (engine/side_lane.py): a
    set of its own, since a split GEMV there may run while one on the main stream counts its
    slices in the other set. None before the first :func:`bind_workspace` with a Workspace."""
    return model.__dict__.get("_fp8_side_semaphores")


def rebind(module: nn.Module, ws: object | None, semaphores: torch.Tensor | None
           ) -> Callable[[], None]:
    """Points every FP8 linear under ``module`` at ``ws`` and ``semaphores`` (a side lane's);
    returns the function that puts back what each had."""
    lins = [m for m in module.modules() if isinstance(m, Fp8Linear)]
    saved = [(m.workspace, m.semaphores) for m in lins]
    for m in lins:
        m.workspace, m.semaphores = ws, (semaphores if ws is not None else None)

    def restore() -> None:
        for m, (w, s) in zip(lins, saved, strict=True):
            m.workspace, m.semaphores = w, s
    return restore




class Mxfp4Experts(nn.Module):
    """Routed experts as shipped: ``gate_up_proj [E, 2I, H/2]`` / ``down_proj [E, H, I/2]``
    packed e2m1 bytes with e8m0 byte scales ``[E, 2I, H/32]`` / ``[E, H, I/32]``. With
    kernels and ``fp8`` (off by default: not yet faster on the H200), a prefill-sized step
    runs the FP8 x FP8 form (``kernels.mxfp4_moe.uses_fp8``)."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.use_kernels = False
        self.fp8 = False
        self.fp8_tiles: tuple[int, int, int, int, int] | None = None  # None: the kernel's choice
        # tiles of the weight-decoding form at prefill sizes (more pairs than a decode step's
        # 256; ``_mxfp4_moe_triton.MoeTiles``); None: the kernel's choice (benchmarks sweep it)
        self.prefill_tiles: tuple[int, ...] | None = None
        self.shape = (num_experts, hidden, inter)
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            self.register_buffer(name, torch.empty(num_experts, rows, cols // 2, dtype=torch.uint8))
            self.register_buffer(name + "_scale", torch.empty(num_experts, rows, cols // 32, dtype=torch.uint8))

    def add_into(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 out: torch.Tensor, swiglu_limit: float, ws: object | None,
                 before_combine: Callable[[], None] | None = None) -> torch.Tensor:
        """out [N, hidden] += sum_j weights[:, j] * expert_{indices[:, j]}(x) (x: [N, hidden]).
        ``before_combine``: called right before the first read of ``out`` is issued."""
        w = (self.gate_up_proj, self.gate_up_proj_scale, self.down_proj, self.down_proj_scale)
        if not self.use_kernels:
            routed = moe_experts_ref(x, weights, indices, *w, swiglu_limit)
            if before_combine is not None:
                before_combine()
            out += routed
            return out
        e, hid, inter = self.shape
        fp8 = self.fp8 and uses_fp8(x.shape[0], hid, inter)
        tiles = self.prefill_tiles if indices.numel() > PREFILL_MIN_PAIRS else None
        if ws is None:
            return moe_experts(x, weights, indices, *w, swiglu_limit, out, accumulate=True, fp8=fp8,
                               fp8_tiles=self.fp8_tiles, tiles=tiles, before_combine=before_combine)
        need = moe_experts_workspace_bytes(x.shape[0], indices.shape[1], hid, inter, e, x.dtype,
                                           fp8)
        with ws.scope():  # type: ignore[attr-defined]
            scratch = ws.take((need,), torch.uint8, caller="deepseek_v4.moe_experts")  # type: ignore[attr-defined]
            return moe_experts(x, weights, indices, *w, swiglu_limit, out, accumulate=True,
                               workspace=scratch, fp8=fp8, fp8_tiles=self.fp8_tiles, tiles=tiles,
                               before_combine=before_combine)


def set_prefill_fp8(model: nn.Module, linears: bool, experts: bool | None = None) -> None:
    """Turns the FP8-activation prefill forms of the FP8 linears and (``experts``, default
    ``linears``) of the MXFP4 experts on or off (off: the weight-only kernels at every size;
    benchmarks compare both)."""
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod.w8a8 = linears
        elif isinstance(mod, Mxfp4Experts):
            mod.fp8 = linears if experts is None else experts
