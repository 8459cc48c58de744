"""engine.device_info: the line a worker logs at start says which device (a card's name, memory
and compute capability; or the CPU's threads and RAM) and which kernel path the config chose."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.device_info import describe_device


def test_cpu_line_names_the_cpu_and_the_torch_path() -> None:
    line = describe_device(EngineConfig(model="m", device="cpu"))
    assert line.startswith(f"device cpu, {torch.get_num_threads()} threads, "), line
    assert f"(torch {torch.__version__})" in line
    assert line.endswith("; kernels: PyTorch ops on CPU"), line


def test_triton_forced_on_cpu_says_interpreter() -> None:
    pytest.importorskip("triton")
    line = describe_device(EngineConfig(model="m", device="cpu", attention_backend="triton"))
    assert "kernels: Triton " in line and "through its interpreter on CPU" in line, line


@pytest.mark.gpu
def test_cuda_line_names_the_card() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    line = describe_device(EngineConfig(model="m", device="cuda"))
    assert line.startswith(f"device cuda:0 {props.name}, "), line
    assert f"compute capability {props.major}.{props.minor}" in line
    assert f"CUDA {torch.version.cuda}" in line
    assert "kernels: Triton " in line and "kernels on CUDA, decode steps as CUDA graphs" in line
    eager = describe_device(EngineConfig(model="m", device="cuda", attention_backend="torch"))
    assert eager.endswith("; kernels: PyTorch ops on CUDA"), eager
