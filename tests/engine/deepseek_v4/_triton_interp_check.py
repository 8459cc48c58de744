"""Run under TRITON_INTERPRET=1 by test_deepseek_v4_triton_interp.py (its own process, because
the variable must be set before triton is imported): the kernels backend, with its scratch taken
from an engine Workspace, against the torch backend on a two-sequence step and five decode
steps of both sequences (decode fused and unfused). Prints the max
differences and the workspace peak."""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from tests.helpers.v4_interp import backend_runs  # noqa: E402

runs = backend_runs("s-csa-hca_yarn_hc2", num_slots=2, ws_tokens=13)
g = torch.Generator().manual_seed(0)
a, b = torch.randint(2, 97, (19,), generator=g), torch.randint(2, 97, (13,), generator=g)
outs = []
peak = 0
# decode "fused" (step/decode_step.py) and "unfused" kernels paths, then the torch reference
for ours, cache, ws in runs:
    h1 = ours(a[:6], torch.arange(6), [0, 6], [1], cache, ws=ws)
    ids = torch.cat([a[6:], b])
    pos = torch.cat([torch.arange(6, 19), torch.arange(13)])
    h2 = ours(ids, pos, [0, 13, 26], [1, 0], cache, ws=ws)
    # then both decode together (step/decode_step.py: the sparse-attention kernel over the window
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
