"""Run under TRITON_INTERPRET=1 by test_deepseek_v4_mixed_step.py (its own process: the variable
must be set before triton is imported): a mixed step of two prefill chunks and three decode
tokens, rows interleaved, on the kernels backend (decode rows through the fused and the unfused
decode kernels; scratch from a locked Workspace) against the torch backend. Prints the max
difference of the step's hidden states and of the decode step after it."""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from tests.helpers.v4_interp import backend_runs  # noqa: E402

# CSA rate 4, HCA rate 8, window 6, blocks of 8
runs = backend_runs("s-csa-hca_yarn_hc2", num_slots=5, ws_tokens=24)
g = torch.Generator().manual_seed(0)
ids = torch.randint(2, 97, (5, 40), generator=g)
before = [11, 0, 7, 15, 20]  # slots 2-4 decode: position 7 closes a CSA and an HCA window
step = [(2, 1), (0, 13), (3, 1), (1, 9), (4, 1)]  # (slot, tokens) in row order
outs = []
for ours, cache, ws in runs:
    for slot, n in enumerate(before):
        if n:
            ours(ids[slot, :n], torch.arange(n), [0, n], [slot], cache, ws=ws)
    qsl = [0]
    for _, n in step:
        qsl.append(qsl[-1] + n)
    tok = torch.cat([ids[s, before[s] : before[s] + n] for s, n in step])
    pos = torch.cat([torch.arange(before[s], before[s] + n) for s, n in step])
    h = ours(tok, pos, qsl, [s for s, _ in step], cache, ws=ws)
    nxt = [before[s] + n for s, n in step]
    h2 = ours(torch.tensor([ids[s, p] for (s, _), p in zip(step, nxt, strict=True)]),
              torch.tensor(nxt), list(range(len(step) + 1)), [s for s, _ in step], cache, ws=ws)
    outs.append((h, h2))
ref = outs[2]
for name, (h, h2) in zip(("fused", "unfused"), outs[:2], strict=True):
    print(f"{name}_mixed_maxdiff={(h - ref[0]).abs().max().item():.3e} "
          f"{name}_next_maxdiff={(h2 - ref[1]).abs().max().item():.3e}")
