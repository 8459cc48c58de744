"""The engine's two kernel paths agree: the PyTorch path and the Triton one (paged attention and
the fused norm/rope/activation kernels; interpreted on CPU, compiled on CUDA), on a mixed batch
of prefill chunks and decodes, for each dense family (Qwen2 biases, Qwen3 q/k norms), over a
KV cache in the model dtype and in FP8."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scoring import drain
from tests.engine.conftest import build_tiny_model


def _run(backend: str, model, device: str, kv_dtype: str = "auto") -> dict[str, list[int]]:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model="tiny", device=device, dtype="float32", max_context=300,
                      chunk_tokens=40, max_batch=4, block_size=16, attn_tile_tokens=32,
                      attention_backend=backend, kv_dtype=kv_dtype)
    engine = LLMEngine(ec, cfg, {k: v.to(device) for k, v in model.state_dict().items()})
    for i, n in enumerate([5, 70, 130]):
        engine.add_request(f"r{i}", [3 + (j * 7) % 120 for j in range(n)],
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return drain(engine)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_triton_paged_attention_matches_torch_path(family, kv_dtype):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    model = build_tiny_model(family)
    # The triton backend also runs the fused kernels (norm+residual, rope+KV write, SiLU*up);
    # with kv_dtype=fp8 both paths write the same FP8 bytes and read them back.
    assert _run("triton", model, device, kv_dtype) == _run("torch", model, device, kv_dtype)
