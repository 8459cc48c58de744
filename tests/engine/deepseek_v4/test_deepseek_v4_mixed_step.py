"""A mixed step (prefill chunks beside decode tokens, what the scheduler runs under load) on
V4-Flash's rates (CSA 4, HCA 128, window 128, blocks of 128): two chunks of odd lengths that
cross a block end, CSA windows and an HCA window, and three decode tokens (one closing the first
HCA window and its block, one closing the second), in both row orders (decode rows contiguous:
views; interleaved with the chunks: gathers). The step's logits, the next decode step's, and
the window snapshots it leaves equal those of running each sequence alone. And the same kind of
step through the Triton kernels (interpreter) against the torch backend."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4KVPool, DeepseekV4Model, V4Backend

ATOL = 2e-5
# slot -> (tokens before the mixed step, tokens in it)
PLAN = {0: (97, 67), 1: (0, 131), 2: (127, 1), 3: (45, 1), 4: (255, 1)}
ORDERS = {"decodes_first": [2, 3, 4, 0, 1], "interleaved": [2, 0, 3, 1, 4]}


def _prompt(slot: int, vocab: int) -> torch.Tensor:
    n = sum(PLAN[slot])
    return torch.randint(2, vocab, (n + 1,), generator=torch.Generator().manual_seed(40 + slot))


def _step(ours: DeepseekV4Model, cache: DeepseekV4KVPool, parts: list[tuple[int, int, int]],
          ids: dict[int, torch.Tensor]) -> torch.Tensor:
    """One step of (slot, first position, tokens) parts in that row order -> logits. Window
    snapshots are planned from the host tables first, as the engine's family does."""
    qsl = [0]
    for s, p, n in parts:
        qsl.append(qsl[-1] + n)
        assert cache.static_tables is not None
        cache.plan_windows(s, cache.static_tables[s], p, n)
    tok = torch.cat([ids[s][p : p + n] for s, p, n in parts])
    pos = torch.cat([torch.arange(p, p + n) for _, p, n in parts])
    return ours.compute_logits(ours(tok, pos, qsl, [s for s, _, _ in parts], cache))


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("backend", [V4Backend("torch", "torch"), V4Backend("kernels_ref", "kernels_ref")],
                         ids=["torch", "kernels_ref"])
def test_mixed_step_equals_sequences_alone(v4_builder: Callable[..., Any], backend: V4Backend,
                                           order: str) -> None:
    model, raw = v4_builder("flash_rates_window128")
    cfg = DeepseekV4Config.from_hf_dict(raw)
    ours = DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=torch.float32, backend=backend)
    ids = {s: _prompt(s, cfg.vocab_size) for s in PLAN}

    def pool() -> DeepseekV4KVPool:
        cache = DeepseekV4KVPool.for_slots(cfg, max_batch=5, max_context=384, dtype=torch.float32,
                                           device="cpu")
        for s, (before, _) in PLAN.items():
            if before:
                _step(ours, cache, [(s, 0, before)], ids)
        return cache

    solo, mixed = pool(), pool()
    rows = ORDERS[order]
    want = torch.cat([_step(ours, solo, [(s, PLAN[s][0], PLAN[s][1])], ids) for s in rows])
    got = _step(ours, mixed, [(s, PLAN[s][0], PLAN[s][1]) for s in rows], ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    assert mixed.num_tokens == solo.num_tokens == [sum(PLAN[s]) for s in range(5)]
    # the state the step left (rings, open compressor windows, entries, indexer keys): one
    # more decode token of every sequence, all together, gives the same logits
    nxt = [(s, sum(PLAN[s]), 1) for s in range(5)]
    torch.testing.assert_close(_step(ours, mixed, nxt, ids), _step(ours, solo, nxt, ids),
                               atol=ATOL, rtol=1e-4)
    # and the window snapshots at the block ends the step crossed (decode rows: from the rings)
    assert set(mixed.windows.slab_of_block) == set(solo.windows.slab_of_block)
    for block in solo.windows.slab_of_block:  # fp32 pool: the bytes are fp32 window rows
        a, b = (p.export_window(block) for p in (mixed, solo))
        assert a is not None and b is not None
        torch.testing.assert_close(a.view(torch.float32), b.view(torch.float32), atol=ATOL, rtol=1e-4)


def test_mixed_step_on_triton_kernels_under_the_interpreter() -> None:
    """The same kind of step through the Triton kernels (interpreter, its own process): the
    chunks' batched attention with the decode rows left empty, the decode rows' fused and
    unfused kernels, against the torch backend."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_mixed_interp_check.py"))],
                          env=env, capture_output=True, text=True, timeout=400, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = dict(re.findall(r"(\w+_maxdiff)=(\S+)", proc.stdout))
    assert len(diffs) == 4, proc.stdout
    assert all(float(v) < 1e-4 for v in diffs.values()), proc.stdout
