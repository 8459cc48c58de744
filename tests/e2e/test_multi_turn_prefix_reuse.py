"""Prefix reuse across turns and workers (issue 9, CPU part): a conversation re-sent with new
text computes only its new tokens, the prefix coming from LMCache/Redis (the workers' own GPU
prefix caches are off here, as after a restart), and after a partial eviction in Redis only the
missing chunks are recomputed. Output always equals a cold transformers run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch

from engine.checkpoint import load_checkpoint
from tests.e2e.conftest import CHUNK, E2E, deploy
from tests.e2e.test_tiny_deployment import complete_ids, token_prompt
from tests.helpers.tiny_model import hf_greedy

BLOCK = 16  # the workers' --block-size (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def cold_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    """Workers that keep no prefix in their own KV blocks: every reuse must come from the store,
    as it would after the worker that served the last turn was replaced."""
    yield from deploy(tmp_path_factory, "--no-enable-prefix-cache")


def _counters(e2e: E2E) -> tuple[float, float]:
    return (e2e.metric("bulkhead_prompt_tokens_total", source="cached"),
            e2e.metric("bulkhead_prompt_tokens_total", source="recomputed"))


def _turn(e2e: E2E, prompt: list[int]) -> tuple[list[int], int, float]:
    """(output ids, usage cached tokens, prompt tokens computed by the workers)."""
    _, recomputed0 = _counters(e2e)
    ids, usage = complete_ids(e2e, prompt, 8, stream=False)
    assert ids == hf_greedy(e2e.folder, prompt, 8)  # the same as a cold run without any cache
    _, recomputed1 = _counters(e2e)
    return ids, usage["prompt_tokens_details"]["cached_tokens"], recomputed1 - recomputed0


def test_each_turn_computes_only_its_new_tokens(cold_workers: E2E) -> None:
    e2e = cold_workers
    turn1 = token_prompt(5 * CHUNK + 3, seed=11)  # 83 tokens
    out1, cached1, computed1 = _turn(e2e, turn1)
    # the store holds whole blocks (16 tokens): the decode worker recomputes the partial last
    # block of each split prompt after the prefill worker computed all of it
    assert cached1 == 0 and computed1 == len(turn1) + len(turn1) % BLOCK

    # Turn 2 re-sends turn 1, its answer and new text; the stored full chunks of turn 1 are
    # loaded and only the rest is computed (the partial last chunk of turn 1 is keyed by its
    # own tokens, so it does not match inside a longer prompt).
    turn2 = turn1 + out1 + token_prompt(3 * CHUNK, seed=12)
    _, cached2, computed2 = _turn(e2e, turn2)
    reused = (len(turn1) // CHUNK) * CHUNK
    assert cached2 == reused
    assert computed2 == len(turn2) - reused + len(turn2) % BLOCK

    # A partial eviction: drop one stored chunk of turn 2 from Redis. The next turn loads the
    # prefix before the hole and recomputes from there; the output is unchanged.
    turn3 = turn2 + token_prompt(2 * CHUNK + 5, seed=13)
    ckpt = load_checkpoint(e2e.folder, torch.float32, progress=False)
    mc = ckpt.config
    from engine.config import EngineConfig
    from engine.models.family import family_class
    from worker.kv_store import KVStore

    layout = family_class(mc).kv_layout(mc, EngineConfig(model="e2e", device="cpu",
                                                         dtype="float32", block_size=16))
    store = KVStore(e2e.deployment.kv_store_url, f"{mc.name}-{ckpt.model_fingerprint[:16]}",
                    layout, chunk_size=CHUNK, staging_gb=0.05)
    try:
        assert store.lookup(turn3) == (len(turn2) // CHUNK) * CHUNK
        start, end, key = store.chunk_keys(turn3)[2]
        assert (start, end) == (2 * CHUNK, 3 * CHUNK)
        client = redis.Redis.from_url(e2e.deployment.kv_store_url)
        assert client.delete(key + "kv_bytes", key + "metadata") == 2
        assert store.lookup(turn3) == 2 * CHUNK
    finally:
        store.close()
    _, cached3, computed3 = _turn(e2e, turn3)
    assert cached3 == 2 * CHUNK
    assert computed3 == len(turn3) - 2 * CHUNK + len(turn3) % BLOCK
