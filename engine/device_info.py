"""One line that says what an engine runs on: the device (a CUDA card's name, memory and compute
capability, or the CPU's threads and RAM) and the kernel path its config chose (Triton kernels
on CUDA, or the PyTorch reference ops). Workers log it at start so an operator sees at once
whether a server runs on the card they meant. Reads device properties only; allocates nothing.
"""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig


def _ram_gib() -> float | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return None


def kernel_path(ec: EngineConfig) -> str:
    """Which kernels serve the model's attention, indexer and MoE under ``ec``."""
    where = "CUDA" if ec.torch_device.type == "cuda" else "CPU"
    if ec.use_triton_attention:
        import triton

        if where == "CPU":
            return f"Triton {triton.__version__} kernels through its interpreter on CPU"
        graphs = ", decode steps as CUDA graphs" if ec.use_cuda_graphs else ""
        return f"Triton {triton.__version__} kernels on CUDA{graphs}"
    return f"PyTorch ops on {where}"


def describe_device(ec: EngineConfig) -> str:
    """``device cuda:0 NVIDIA H100 80GB HBM3, 79.1 GiB, compute capability 9.0 (torch 2.11.0+cu130,
    CUDA 13.0); kernels: Triton 3.6.0 kernels on CUDA, ...`` or ``device cpu, 2 threads, 23.4
    GiB RAM (torch 2.13.0+cpu); kernels: PyTorch ops on CPU``."""
    dev = ec.torch_device
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        what = (f"device cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                f"compute capability {props.major}.{props.minor} "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    else:
        ram = _ram_gib()
        what = (f"device {dev.type}, {torch.get_num_threads()} threads"
                + (f", {ram:.1f} GiB RAM" if ram is not None else "")
                + f" (torch {torch.__version__})")
    return f"{what}; kernels: {kernel_path(ec)}"
