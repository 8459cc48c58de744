"""Run under TRITON_INTERPRET=1 by test_deepseek_v4_quantized.py: a prompt long enough for the
FP8 linears' w8a8 prefill form (activations quantized per 1 x 128; ``W8A8_MIN_ROWS`` rows and
up), then greedy decode steps, three ways: the Triton kernels (scratch from a locked Workspace
sized by the family's size function, FP8 linears counted); the torch references with the
prefill form's specification (``kernels.fp8_w8a8_ref``) swapped in from the same row count;
the weight-only torch references (what the CPU engine runs)."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

import engine.models.deepseek_v4.weights.quant_modules as qm  # noqa: E402
import kernels.fp8_w8a8 as w8a8  # noqa: E402
from engine.checkpoint import load_checkpoint  # noqa: E402
from engine.models.deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
    DeepseekV4KVPool,
    DeepseekV4Model,
    V4Backend,
)
from engine.models.deepseek_v4.memory.sizing import deepseek_v4_workspace_bytes  # noqa: E402
from engine.workspace import Workspace  # noqa: E402
from kernels.fp8_w8a8 import W8A8_MIN_ROWS  # noqa: E402

# This tiny model's projections are far narrower than W8A8_MIN_N (a speed rule for V4-Flash's
# shapes, tested in tests/kernels/test_fp8_w8a8.py): lift it so the form runs here at all.
w8a8.W8A8_MIN_N = 0
from kernels.fp8_w8a8_ref import fp8_grouped_linear_w8a8_ref, fp8_linear_w8a8_ref  # noqa: E402

WEIGHT_ONLY = (qm.fp8_linear_ref, qm.fp8_grouped_linear_ref)


def _by_rows(w8a8, weight_only):  # the kernels' switch, on the reference side
    return lambda x, *a: (w8a8 if x.shape[0] >= W8A8_MIN_ROWS else weight_only)(x, *a)


ck = load_checkpoint(sys.argv[1], torch.float32, progress=False)
cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
n = W8A8_MIN_ROWS + 2
ids = torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(5))
ws = Workspace(deepseek_v4_workspace_bytes(cfg, n, n + 8, mxfp4_experts=True, dtype=torch.float32,
                                           fp8_linears=True), "cpu")
ws.lock()
result, prefill = {}, {}
for mode in ("kernels", "spec", "weight-only"):
    if mode == "spec":
        qm.fp8_linear_ref = _by_rows(fp8_linear_w8a8_ref, WEIGHT_ONLY[0])
        qm.fp8_grouped_linear_ref = _by_rows(fp8_grouped_linear_w8a8_ref, WEIGHT_ONLY[1])
    else:
        qm.fp8_linear_ref, qm.fp8_grouped_linear_ref = WEIGHT_ONLY
    gemm = "kernels" if mode == "kernels" else "torch"
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32,
                                           backend=V4Backend("torch", "torch", gemm))
    qm.set_prefill_fp8(ours, True)  # opt-in (the references ignore it)
    cache = DeepseekV4KVPool.for_slots(cfg, 1, n + 8, torch.float32, "cpu")
    with ws.scope():
        h = ours(ids, torch.arange(n), [0, n], [0], cache, ws=ws)
    prefill[mode] = ours.compute_logits(h)
    tokens = [int(prefill[mode][-1].argmax())]
    for _ in range(3):
        with ws.scope():
            h = ours(torch.tensor([tokens[-1]]), torch.tensor([cache.num_tokens[0]]), [0, 1], [0],
                     cache, ws=ws)
        tokens.append(int(ours.compute_logits(h)[0].argmax()))
    result[mode] = ",".join(map(str, tokens))


def _cmp(a: str, b: str) -> str:
    x, y = prefill[a], prefill[b]
    return (f"{float((x - y).norm() / y.norm()):.4f}/"
            f"{float((x.argmax(-1) == y.argmax(-1)).float().mean()):.3f}")


print(f"kernels={result['kernels']} spec={result['spec']} weight_only={result['weight-only']} "
      f"kernels_vs_spec={_cmp('kernels', 'spec')} spec_vs_weight_only={_cmp('spec', 'weight-only')} "
      f"ws_peak={ws.peak_bytes} ws_cap={ws.capacity}")
