"""The engine-facing adapter: StepBatch steps with two sequences interleaved (one in chunked
prefill while the other decodes) give transformers' greedy tokens; slot reuse resets state; a
step that does not continue the slot's state is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4.runner import DeepseekV4Runner
from engine.step_batch import StepBatch


def _batch(seqs: list[tuple[list[int], int, int]]) -> StepBatch:
    """seqs: (token ids of this step, start position, slot)."""
    ids, pos, qsl, ctx, slots = [], [], [0], [], []
    for toks, start, slot in seqs:
        ids += toks
        pos += list(range(start, start + len(toks)))
        qsl.append(qsl[-1] + len(toks))
        ctx.append(start + len(toks))
        slots.append(slot)
    n = len(ids)
    return StepBatch(torch.tensor(ids), torch.tensor(pos), torch.zeros(n, dtype=torch.long), qsl, ctx,
                     [[] for _ in seqs], slots, torch.tensor([q - 1 for q in qsl[1:]]))


def test_interleaved_sequences_match_generate(v4_builder: Callable[..., Any]) -> None:
    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    g = torch.Generator().manual_seed(11)
    a, b = torch.randint(2, 97, (21,), generator=g).tolist(), torch.randint(2, 97, (18,), generator=g).tolist()
    want = {}
    for name, p in (("a", a), ("b", b)):
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        want[name] = out[0, len(p):].tolist()
    runner = DeepseekV4Runner(raw, model.state_dict(), max_batch=2, max_context=40, dtype=torch.float32)
    got: dict[str, list[int]] = {"a": [], "b": []}

    def step(seqs: list[tuple[str, list[int], int, int]]) -> None:
        batch = _batch([(t, s, slot) for _, t, s, slot in seqs])
        logits = runner.compute_logits(runner.forward(batch)[batch.logits_indices])
        for (name, toks, start, _slot), lg in zip(seqs, logits, strict=True):
            full = a if name == "a" else b
            if start + len(toks) >= len(full):  # prompt done: the row's argmax is an output token
                got[name].append(int(lg.argmax()))

    step([("a", a[:21], 0, 1)])  # a prefilled at once in slot 1
    step([("a", [got["a"][-1]], 21, 1), ("b", b[:7], 0, 0)])  # a decodes, b's first chunk
    step([("b", b[7:18], 7, 0), ("a", [got["a"][-1]], 22, 1)])
    for i in range(4):
        step([("a", [got["a"][-1]], 23 + i, 1), ("b", [got["b"][-1]], 18 + i, 0)])
    assert got["a"][:6] == want["a"]
    assert got["b"][:5] == want["b"][:5]
    # slot 1 reused by a new sequence: state restarts at position 0
    step([("a", a[:21], 0, 1)])
    assert runner.cache.num_tokens[1] == 21
    with pytest.raises(InvalidRequest, match="cannot be rewound"):
        runner.forward(_batch([([5], 30, 0)]))
