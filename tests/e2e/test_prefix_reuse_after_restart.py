"""Prefix reuse after a real worker restart (issue 9): the workers keep their own GPU prefix
caches on, turn 1 takes the split route, then both worker processes are stopped (SIGTERM) and
started again with the same command line and port. Turn 2 re-sends turn 1, its answer and new
text: every stored full chunk of turn 1 comes from Redis (no process alive holds it in KV
blocks), only the new tokens are computed, and the output equals a cold transformers run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import CHUNK, E2E, SPLIT_THRESHOLD, deploy
from tests.e2e.test_multi_turn_prefix_reuse import _turn
from tests.e2e.test_tiny_deployment import token_prompt


@pytest.fixture(scope="module")
def warm_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    """Workers with their GPU prefix cache on (the default), as in production."""
    yield from deploy(tmp_path_factory)


def test_turn_after_restart_loads_the_prefix_from_redis(warm_workers: E2E) -> None:
    e2e = warm_workers
    turn1 = token_prompt(5 * CHUNK + 3, seed=21)  # 83 tokens
    assert len(turn1) >= SPLIT_THRESHOLD  # the split route: the prefill worker stores the KV
    split0 = e2e.metric("bulkhead_time_to_first_token_seconds_count", route="split")
    out1, cached1, computed1 = _turn(e2e, turn1)
    # the decode worker recomputes the partial last block (16 tokens) the store does not hold
    assert cached1 == 0 and computed1 == len(turn1) + len(turn1) % 16
    assert e2e.metric("bulkhead_time_to_first_token_seconds_count", route="split") == split0 + 1

    pids = {p.pid for p in e2e.deployment.group.processes}
    e2e.restart_workers("prefill", "decode")
    assert len({p.pid for p in e2e.deployment.group.processes} - pids) == 2  # new processes

    turn2 = turn1 + out1 + token_prompt(3 * CHUNK, seed=22)
    split1 = e2e.metric("bulkhead_time_to_first_token_seconds_count", route="split")
    _, cached2, computed2 = _turn(e2e, turn2)
    # Only the full chunks of turn 1 are keyed by a prefix of turn 2 (the partial last chunk
    # is keyed by its own tokens); the new processes can have found them only in Redis.
    reused = (len(turn1) // CHUNK) * CHUNK
    assert cached2 == reused
    assert computed2 == len(turn2) - reused + len(turn2) % 16
    assert e2e.metric("bulkhead_time_to_first_token_seconds_count", route="split") == split1 + 1
