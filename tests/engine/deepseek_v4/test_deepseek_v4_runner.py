"""The family adapter (DeepseekV4Family over a pool of blocks): StepBatch steps with two
sequences interleaved (one in chunked prefill while the other decodes) give transformers' greedy
tokens; slot reuse resets state; a step that does not continue the slot's state is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.family import DeepseekV4Family
from engine.step_batch import StepBatch
from tests.engine.deepseek_v4.conftest import step_batch

BS = 8  # lcm of the config's rates (4, 8)
TABLES = {0: list(range(6, 11)), 1: list(range(1, 6))}  # 5 blocks of 8 = 40 tokens per slot


def _batch(seqs: list[tuple[list[int], int, int]]) -> StepBatch:
    return step_batch(seqs, TABLES)


def test_interleaved_sequences_match_generate(v4_builder: Callable[..., Any]) -> None:
    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    g = torch.Generator().manual_seed(11)
    a, b = torch.randint(2, 97, (21,), generator=g).tolist(), torch.randint(2, 97, (18,), generator=g).tolist()
    want = {}
    for name, p in (("a", a), ("b", b)):
        out = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        want[name] = out[0, len(p):].tolist()
    mc = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=2, max_context=40,
                      block_size=BS, attn_tile_tokens=BS)
    runner = DeepseekV4Family(mc, dict(model.state_dict()), ec)
    pool = DeepseekV4Family.kv_layout(mc, ec).allocate(11, torch.device("cpu"))
    got: dict[str, list[int]] = {"a": [], "b": []}

    def step(seqs: list[tuple[str, list[int], int, int]]) -> None:
        batch = _batch([(t, s, slot) for _, t, s, slot in seqs])
        logits = runner.compute_logits(runner.forward(batch, pool, None)[batch.logits_indices],
                                       torch.empty(len(seqs), 97))
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
    assert pool.num_tokens[1] == 21
    with pytest.raises(InvalidRequest, match="continues at position 30"):
        runner.forward(_batch([([5], 30, 0)]), pool, None)
