"""Run under TRITON_INTERPRET=1 by test_deepseek_v4_quantized.py: the quantized checkpoint in
argv[1] decoded greedily with the FP8 / MXFP4 Triton kernels (scratch from a locked engine
Workspace sized by the family's size function), with their torch references, and with every
kernel and the fused decode path."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from engine.checkpoint import load_checkpoint  # noqa: E402
from engine.models.deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
    DeepseekV4KVPool,
    DeepseekV4Model,
    V4Backend,
)
from engine.models.deepseek_v4.memory.sizing import deepseek_v4_workspace_bytes  # noqa: E402
from engine.workspace import Workspace  # noqa: E402

ck = load_checkpoint(sys.argv[1], torch.float32, progress=False)
cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
ids = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4))
result = {}
ws = Workspace(deepseek_v4_workspace_bytes(cfg, 13, 32, mxfp4_experts=True, dtype=torch.float32), "cpu")
ws.lock()
backends = {
    "kernels": V4Backend("torch", "torch", "kernels"),
    "torch": V4Backend("torch", "torch", "torch"),
    # every kernel, decode steps through the fused path (step/decode_step.py: fused MoE routing and
    # shared-expert SwiGLU in front of the MXFP4 experts), with its side lane
    "fused": V4Backend("kernels", "kernels", "kernels", decode="fused", lanes=2),
    # the same on one lane (no side lane: step/decode_step.py)
    "fused1": V4Backend("kernels", "kernels", "kernels", decode="fused", lanes=1),
    # two lanes, the side's work run at each join (after the main stream's work since the fork)
    "deferred": V4Backend("kernels", "kernels", "kernels", decode="fused", lanes=2),
}
import kernels._moe_decode_triton as _moe_launch  # noqa: E402

routers = []  # the fused decode's router launches (the linear and routing in one kernel)
_launch_router = _moe_launch.launch_moe_router
_moe_launch.launch_moe_router = lambda *a: (routers.append(1), _launch_router(*a))
import engine.side_lane as _side_lane  # noqa: E402

forks: dict[str, int] = {}  # side-lane work issued by each backend's decode steps
_run = _side_lane.SideLane.run
current = [""]


def _counted_run(self, *a, **kw):  # noqa: ANN001, ANN202
    forks[current[0]] = forks.get(current[0], 0) + 1
    return _run(self, *a, **kw)


_side_lane.SideLane.run = _counted_run
decode_h: dict[str, list[torch.Tensor]] = {}  # each backend's decode steps' hidden states
for gemm, backend in backends.items():
    current[0] = gemm
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32, backend=backend)
    if gemm == "deferred":  # the fused loop takes the lane the model holds (decode_side)
        ours.__dict__["_side_lane"] = _side_lane.SideLane(torch.device("cpu"), defer=True)
    cache = DeepseekV4KVPool.for_slots(cfg, 1, 32, torch.float32, "cpu")
    with ws.scope():
        h = ours(ids, torch.arange(13), [0, 13], [0], cache, ws=ws)
    tokens = [int(ours.compute_logits(h)[-1].argmax())]
    for _ in range(4):
        with ws.scope():
            h = ours(torch.tensor([tokens[-1]]), torch.tensor([cache.num_tokens[0]]), [0, 1], [0], cache, ws=ws)
        tokens.append(int(ours.compute_logits(h)[0].argmax()))
        decode_h.setdefault(gemm, []).append(h.clone())
    result[gemm] = ",".join(map(str, tokens))
lane_diff = max(float((a - b).abs().max()) for other in ("fused1", "deferred")
                for a, b in zip(decode_h["fused"], decode_h[other], strict=True))
print(f"lane_hidden_maxdiff={lane_diff:.3e}")
print(f"fused={result['fused']} routers={len(routers)} one_lane={result['fused1']} "
      f"deferred={result['deferred']} forks={forks.get('fused', 0)} "
      f"forks_one_lane={forks.get('fused1', 0)} forks_deferred={forks.get('deferred', 0)}")
print(f"kernels={result['kernels']} torch={result['torch']} ws_peak={ws.peak_bytes} ws_cap={ws.capacity}")
