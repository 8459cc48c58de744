"""Projections that read the same input, run as ONE GEMM over their row-concatenated weights.

A decode step at batch 1 is launch-bound: each FP8 GEMV of a small matrix costs a fixed few
microseconds beyond its bytes (and its split-K variant a second, reduce, launch). Where two or
more projections of a block take exactly the same input tensor and keep their weights in the
same form, :func:`.merged_groups.merge_projections` (run once, when the model is finalized
after loading) concatenates their weights into one tensor and makes each module's ``weight``
(and FP8 ``scale`` grid) a row-slice view into it: the resident bytes do not change,
``state_dict()`` keeps every name and shape, and the modules still work on their own. The block then calls the
:class:`MergedLinear` once and splits its output by views (no copies).

Which projections of V4 merge is merged_groups.py's; this module is the mechanism.

FP8 parts merge only when their scale grids concatenate along N: same block, same K, and every
part but the last a whole number of scale-block rows (the last may end in a partial block, as
the merged grid then does). Anything else (mixed formats, biases, a meta or unloaded module)
stays unmerged. A merged projection checks on every call (host-side pointers, no sync) that its
parts are still views into its weight (``Module.to`` to another device replaces them) and falls
back to the parts otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear


class MergedLinear:
    """One GEMM for ``parts`` (modules whose weights are consecutive row slices of ``weight``);
    calling it returns each part's output, views of one ``[..., sum(sizes)]`` result. Not an
    ``nn.Module`` (its tensors are the parts' own, counted and named once, by the parts)."""

    def __init__(self, parts: Sequence[nn.Module], weight: torch.Tensor,
                 scale: torch.Tensor | None, block: tuple[int, int] | None) -> None:
        self.parts = tuple(parts)
        self.sizes = tuple(int(p.weight.shape[0]) for p in parts)
        self.weight, self.scale = weight, scale
        self._lin: Fp8Linear | None = None
        if scale is not None:
            assert block is not None
            with torch.device("meta"):  # its tensors are the merged ones, set below
                lin = Fp8Linear(tuple(weight.shape))
            lin.weight, lin.scale, lin.block = weight, scale, block
            self._lin = lin

    def intact(self) -> bool:
        """Whether every part still holds its row slice of the merged tensors."""
        row, off = self.weight.stride(0) * self.weight.element_size(), 0
        base = self.weight.data_ptr()
        for p, n in zip(self.parts, self.sizes, strict=True):
            if p.weight.data_ptr() != base + off * row or p.weight.device != self.weight.device:
                return False
            off += n
        if self.scale is not None:
            srow, soff = self.scale.stride(0) * self.scale.element_size(), 0
            for p in self.parts:
                if p.scale.data_ptr() != self.scale.data_ptr() + soff * srow:
                    return False
                soff += p.scale.shape[0]
        return True

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.intact():
            return tuple(p(x) for p in self.parts)
        if self._lin is None:
            y = F.linear(x, self.weight)
        else:
            first, lin = self.parts[0], self._lin
            # the parts' settings (bind_workspace, set_prefill_fp8, the loader's use_kernels)
            lin.use_kernels, lin.w8a8, lin.workspace = first.use_kernels, first.w8a8, first.workspace
            lin.semaphores = first.semaphores
            y = lin(x)
        return y.split(self.sizes, dim=-1)


def merge_linears(parts: Sequence[nn.Module]) -> MergedLinear | None:
    """Concatenate ``parts``' weights (rows, in order) into one tensor whose slices become the
    parts' weights (and FP8 scale grids); None, untouched, where they cannot merge."""
    if len(parts) < 2:
        return None
    ws = [getattr(p, "weight", None) for p in parts]
    if any(not isinstance(w, torch.Tensor) or w.dim() != 2 or w.is_meta for w in ws):
        return None
    w0 = ws[0]
    if any(w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or w.device != w0.device for w in ws):
        return None
    if all(type(p) is Fp8Linear for p in parts):
        block = parts[0].block
        scales = [p.scale for p in parts]
        for p, w, s in zip(parts, ws, scales, strict=True):
            grid = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
            if p.groups != 1 or p.block != block or tuple(s.shape) != grid or s.is_meta:
                return None
        if any(w.shape[0] % block[0] for w in ws[:-1]):
            return None  # a scale block would straddle two parts
        weight, scale = torch.cat(ws), torch.cat(scales)
        row = sgrid = 0
        for p, w, s in zip(parts, ws, scales, strict=True):
            p._buffers["weight"] = weight[row:row + w.shape[0]]
            p._buffers["scale"] = scale[sgrid:sgrid + s.shape[0]]
            row, sgrid = row + w.shape[0], sgrid + s.shape[0]
        return MergedLinear(parts, weight, scale, block)
    if all(type(p) is nn.Linear and p.bias is None for p in parts):
        weight, row = torch.cat([w.detach() for w in ws]), 0
        for p, w in zip(parts, ws, strict=True):
            p._parameters["weight"] = nn.Parameter(weight[row:row + w.shape[0]],
                                                   requires_grad=False)
            row += w.shape[0]
        return MergedLinear(parts, weight, None, None)
    return None
