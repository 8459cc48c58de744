"""The DeepSeek-V4 interpreter checks' common setup (tests/engine/deepseek_v4/_*_interp_check.py,
each run in its own process under TRITON_INTERPRET=1): one small HF-built model, loaded once a
backend, each with its own KV pool and a locked engine Workspace. The kernels backends are
compared against the torch backend, which comes last."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4KVPool,
    DeepseekV4Model,
    V4Backend,
)
from engine.models.deepseek_v4.memory.sizing import deepseek_v4_workspace_bytes
from engine.workspace import Workspace
from tests.engine.deepseek_v4.conftest import build_hf_v4

# the decode step fused (step/decode_step.py, DecodeLoop.FUSED) and unfused on the kernels, then the torch reference
BACKENDS = (V4Backend("kernels", "kernels", decode="fused"),
            V4Backend("kernels", "kernels", decode="unfused"), V4Backend("torch", "torch"))


def backend_runs(variant: str, num_slots: int, ws_tokens: int
                 ) -> Iterator[tuple[DeepseekV4Model, DeepseekV4KVPool, Workspace]]:
    """(model, KV pool of ``num_slots`` sequences, locked workspace for steps of up to
    ``ws_tokens`` tokens) for each of ``BACKENDS`` in turn; pools of 32 positions, fp32."""
    model, raw = build_hf_v4(variant)
    cfg = DeepseekV4Config.from_hf_dict(raw)

    def runs() -> Iterator[tuple[DeepseekV4Model, DeepseekV4KVPool, Workspace]]:
        for backend in BACKENDS:
            ours = DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=torch.float32,
                                                   backend=backend)
            cache = DeepseekV4KVPool.for_slots(cfg, num_slots, 32, torch.float32, "cpu")
            ws = Workspace(deepseek_v4_workspace_bytes(cfg, ws_tokens, 32), "cpu")
            ws.lock()
            yield ours, cache, ws

    return runs()
