"""Run under TRITON_INTERPRET=1 by test_deepseek_v4_triton_interp.py (its own process, because
the variable must be set before triton is imported): the kernels backend, with its scratch taken
from an engine Workspace, against the torch backend on a two-sequence step and five decode
steps of both sequences (decode fused and unfused). Prints the max
differences and the workspace peak."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(__file__))

from conftest import build_hf_v4  # noqa: E402

from engine.models.deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
    DeepseekV4KVPool,
    DeepseekV4Model,
    V4Backend,
)
from engine.models.deepseek_v4.sizing import deepseek_v4_workspace_bytes  # noqa: E402
from engine.workspace import Workspace  # noqa: E402

model, raw = build_hf_v4("s-csa-hca_yarn_hc2")
cfg = DeepseekV4Config.from_hf_dict(raw)
g = torch.Generator().manual_seed(0)
a, b = torch.randint(2, 97, (19,), generator=g), torch.randint(2, 97, (13,), generator=g)
outs = []
peak = 0
# decode "fused" (decode_fused.py) and "unfused" kernels paths, then the torch reference
for backend in (V4Backend("kernels", "kernels", decode="fused"),
                V4Backend("kernels", "kernels", decode="unfused"), V4Backend("torch", "torch")):
    ours = DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=torch.float32, backend=backend)
    cache = DeepseekV4KVPool.for_slots(cfg, 2, 32, torch.float32, "cpu")
    ws = Workspace(deepseek_v4_workspace_bytes(cfg, 13, 32), "cpu")
    ws.lock()
    h1 = ours(a[:6], torch.arange(6), [0, 6], [1], cache, ws=ws)
    ids = torch.cat([a[6:], b])
    pos = torch.cat([torch.arange(6, 19), torch.arange(13)])
    h2 = ours(ids, pos, [0, 13, 26], [1, 0], cache, ws=ws)
    # then both decode together (decode_step.py: the sparse-attention kernel over the window
    # rings and the pool's entry rows), across CSA (rate 4) and HCA (rate 8) window closings
    steps = []
    for k in range(5):
        tok = torch.tensor([(7 * k + 3) % 97, (5 * k + 11) % 97])
        steps.append(ours(tok, torch.tensor([19 + k, 13 + k]), [0, 1, 2], [1, 0], cache, ws=ws))
    outs.append(torch.cat([h1, h2, *steps]))
    peak = max(peak, ws.peak_bytes)
dec = slice(-10, None)  # the five decode steps of both sequences
print(f"fused_decode_maxdiff={(outs[0][dec] - outs[2][dec]).abs().max().item():.3e}")
print(f"maxdiff={(outs[0] - outs[2]).abs().max().item():.3e} "
      f"unfused_maxdiff={(outs[1] - outs[2]).abs().max().item():.3e} ws_peak={peak} ws_cap={ws.capacity}")
