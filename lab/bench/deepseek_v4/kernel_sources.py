"""Where a DeepSeek-V4 decode step's kernels come from: device kernels grouped by family (from a
profiler trace, graph replays included) and, for an eager step, the PyTorch ops that launch work
counted by the function of ours that called them. Used by :mod:`.profile_decode` to say which
parts of a layer are worth fusing; never used by the engine.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that launch no device work (views, allocations, metadata).
_NO_WORK = {"empty", "empty_like", "empty_strided", "new_empty", "detach", "lift_fresh", "alias",
            "t", "view", "_unsafe_view", "expand", "as_strided", "split", "split_with_sizes",
            "unbind", "slice", "select", "unsqueeze", "squeeze", "permute", "transpose",
            "view_as_complex", "view_as_real", "unflatten", "_reshape_alias", "resolve_conj",
            "resolve_neg", "set_", "record_stream", "is_same_size", "sym_size", "sym_stride"}
_OURS = ("/engine/", "/kernels/")

_TRITON = (  # a Triton kernel is named after its function ("_name_kernel"); first match wins
    ("Triton: mHC fused (hc_decode)", ("_hc_mix", "_hc_finish", "_hc_norm")),
    ("Triton: norm+RoPE (rope_norm)", ("_rope_norm",)),
    ("Triton: mHC merge/collapse/Sinkhorn", ("_hc_merge", "_hc_collapse", "_sinkhorn")),
    ("Triton: FP8 GEMM/GEMV", ("_fp8_",)),
    ("Triton: MoE", ("_moe_",)),
    ("Triton: sparse attention", ("_sparse_attention",)),
    ("Triton: compressor (compress_decode)", ("_compress",)),
    ("Triton: other", ("",)),
)
_OTHERS = (  # PyTorch's and cuBLAS's kernels
    ("cuBLAS GEMM", ("gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "splitK")),
    ("top-k / sort", ("topk", "TopK", "sort", "Sort", "radix")),
    ("softmax", ("softmax", "SoftMax")),
    ("gather / scatter / index", ("gather", "scatter", "index", "Index")),
    ("reduction", ("reduce_kernel", "Reduce")),
    ("cat", ("cat", "Cat")),
    ("copies / fills", ("Memcpy", "Memset", "copy", "fill")),
    ("elementwise", ("elementwise",)),
)


def kernel_family(name: str) -> str:
    for family, fragments in _TRITON if name.startswith("_") else _OTHERS:
        if any(f in name for f in fragments):
            return family
    return "other"


def family_table(events: Any, steps: int, layers: int) -> str:
    """Device kernels of a profile (``key_averages()``) by family: per step, per layer, device
    time per step."""
    count: Counter[str] = Counter()
    us: Counter[str] = Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            fam = kernel_family(e.key)
            count[fam] += e.count
            us[fam] += getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
    lines = [f"{'kernel family':<40} {'per step':>9} {'per layer':>10} {'us/step':>9}"]
    for fam, c in count.most_common():
        lines.append(f"{fam:<40} {c / steps:9.1f} {c / steps / layers:10.1f} {us[fam] / steps:9.1f}")
    lines.append(f"{'total':<40} {sum(count.values()) / steps:9.1f} "
                 f"{sum(count.values()) / steps / layers:10.1f} {sum(us.values()) / steps:9.1f}")
    return "\n".join(lines)


class OpSources(TorchDispatchMode):
    """Counts the PyTorch ops that launch device work, by the innermost function of ours
    (engine/, kernels/) on the Python stack when each was dispatched. Triton launches do not
    pass through here (the family table counts them). ``out_bytes`` sums the bytes each source's
    ops write (their tensor outputs), the weight of a glue op at a chunk's sizes; ``op_bytes``
    the same per (source, op)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.out_bytes: Counter[str] = Counter()
        self.op_bytes: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _NO_WORK and not getattr(func, "is_view", False):
            f = sys._getframe(1)
            while f is not None and not any(o in f.f_code.co_filename for o in _OURS):
                f = f.f_back
            src = "?" if f is None else (f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:"
                                        f"{f.f_code.co_name}")
            self.counts[src] += 1
            out = func(*args, **(kwargs or {}))
            written = sum(t.numel() * t.element_size() for t in _tensors(out))
            self.out_bytes[src] += written
            self.op_bytes[(src, name)] += written
            return out
        return func(*args, **(kwargs or {}))

    def table(self, layers: int) -> str:
        lines = [f"{'source (aten ops that launch work)':<52} {'per step':>9} {'per layer':>10}"]
        for src, c in self.counts.most_common():
            lines.append(f"{src:<52} {c:9d} {c / layers:10.1f}")
        total = sum(self.counts.values())
        lines.append(f"{'total':<52} {total:9d} {total / layers:10.1f}")
        return "\n".join(lines)

    def bytes_table(self, layers: int, top: int = 40) -> str:
        """(source, op) pairs by the bytes their outputs wrote, heaviest first."""
        lines = [f"{'source':<46} {'op':<22} {'MiB/step':>10} {'MiB/layer':>10}"]
        for (src, op), b in self.op_bytes.most_common(top):
            lines.append(f"{src:<46} {op:<22} {b / 2**20:10.2f} {b / 2**20 / layers:10.2f}")
        total = sum(self.op_bytes.values())
        lines.append(f"{'total':<69} {total / 2**20:10.2f} {total / 2**20 / layers:10.2f}")
        return "\n".join(lines)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of an op's output (a tensor, or a tuple/list holding some)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
