"""Resume points in a real redis-server (worker/resume_points.py), with a DeepSeek-V4 pool on the
CPU: keys chain over the token prefix; only block ends that hold a window snapshot are stored,
once (a second put only refreshes the TTL); the longest stored one comes back bit-exact, and a
value of the wrong size is ignored rather than imported."""

from __future__ import annotations

import redis
import torch

from tests.worker.test_lmcache_connector import LAYOUTS
from worker.resume_points import KEY_PREFIX, ResumePoints


def _points(url: str, layout, ttl_s: int = 60) -> ResumePoints:  # noqa: ANN001
    return ResumePoints(redis.Redis.from_url(url), "ns-1", layout.block_size,
                        layout.resume_state_bytes, ttl_s)


def test_keys_chain_over_the_prefix(redis_url: str) -> None:
    layout = LAYOUTS["v4"]()
    rp = _points(redis_url, layout)
    bs = layout.block_size
    tokens = list(range(100, 100 + 3 * bs + 5))  # 3 whole blocks and a partial one
    keys = rp.keys(tokens)
    assert [e for e, _ in keys] == [bs, 2 * bs, 3 * bs]
    assert all(k.startswith(KEY_PREFIX) for _, k in keys)
    assert rp.keys(tokens[:2 * bs]) == keys[:2]  # a prefix's keys are the longer prompt's
    other = tokens[:bs] + [7] + tokens[bs + 1:]
    assert rp.keys(other)[0] == keys[0] and rp.keys(other)[1][1] != keys[1][1]
    assert ResumePoints(None, "ns-2", bs, 1, 0).keys(tokens)[0][1] != keys[0][1]


def test_only_block_ends_with_a_window_are_stored_once(redis_url: str) -> None:
    layout = LAYOUTS["v4-fp8"]()
    bs, wb = layout.block_size, layout.resume_state_bytes
    kv = layout.allocate(8, torch.device("cpu"))
    table = [5, 2, 7, 3]
    g = torch.Generator().manual_seed(0)
    windows = {b: torch.randint(0, 256, (wb,), dtype=torch.uint8, generator=g) for b in (2, 3)}
    for block, w in windows.items():  # resume points at the ends of blocks 2 and 4 of the prompt
        layout.import_resume_state(kv, block, w)
    tokens = list(range(4 * bs + 3))
    rp = _points(redis_url, layout)
    assert rp.put(tokens, kv, table, layout) == 2 * wb
    r = redis.Redis.from_url(redis_url)
    keys = dict(rp.keys(tokens))
    assert [bool(r.exists(keys[e])) for e in (bs, 2 * bs, 3 * bs, 4 * bs)] == [0, 1, 0, 1]
    assert 0 < r.ttl(keys[4 * bs]) <= 60
    assert rp.put(tokens, kv, table, layout) == 0  # stored already: nothing sent again
    ends = rp.stored_ends(tokens, 4 * bs)
    assert [e for e, _ in ends] == [4 * bs, 2 * bs]  # longest first
    assert [e for e, _ in rp.stored_ends(tokens, 4 * bs - 1)] == [2 * bs]
    assert torch.equal(rp.get(ends[0][1]), windows[3])
    r.set(keys[2 * bs], b"short")
    assert rp.get(keys[2 * bs]) is None  # not a window of this layout: never imported


def test_a_store_without_redis_keeps_none() -> None:
    layout = LAYOUTS["v4"]()
    rp = ResumePoints(None, "ns", layout.block_size, layout.resume_state_bytes, 0)
    kv = layout.allocate(3, torch.device("cpu"))
    assert rp.put(list(range(2 * layout.block_size)), kv, [1, 2], layout) == 0
    assert rp.stored_ends(list(range(2 * layout.block_size)), 2 * layout.block_size) == []
