"""Turns logits into tokens: greedy, temperature, top-k, top-p, with a generator per request.

Works row by row on workspace buffers so sampling never allocates vocab-sized tensors of its own.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.workspace import Workspace


def sampler_workspace_bytes(vocab_size: int) -> int:
    return 3 * 256 + vocab_size * (4 + 8 + 4)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], ws: Workspace) -> list[int]:
    """logits: [n, vocab] fp32 (modified in place) -> one token per row."""
    n, vocab = logits.shape
    tokens = [0] * n
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    if len(greedy) == n:  # the common decode case: one argmax over the batch, one sync
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, t in zip(greedy, logits.index_select(0, idx).argmax(dim=-1).tolist(), strict=True):
            tokens[i] = int(t)
    with ws.scope():
        vals = ws.take((vocab,), torch.float32, caller="sampler.sorted_values")
        order = ws.take((vocab,), torch.int64, caller="sampler.sorted_indices")
        probs = ws.take((vocab,), torch.float32, caller="sampler.probs")
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            row = logits[i]
            row.div_(p.temperature)
            torch.sort(row, descending=True, out=(vals, order))
            keep = vocab
            if p.top_k > 0:
                keep = min(keep, p.top_k)
            # softmax over the sorted row (stable: subtract the max)
            torch.sub(vals, vals[0], out=probs)
            probs.exp_()
            probs[keep:] = 0
            probs.div_(probs.sum())
            if p.top_p < 1.0:
                # keep the smallest prefix whose mass reaches top_p (always at least one token)
                torch.cumsum(probs, dim=0, out=vals)
                cut = int(torch.searchsorted(vals, torch.tensor(p.top_p, device=vals.device)))
                probs[cut + 1 :] = 0
                probs.div_(probs.sum())
            choice = torch.multinomial(probs, 1, generator=generators[i])
            tokens[i] = int(order[choice])
    return tokens
