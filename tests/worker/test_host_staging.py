"""The fixed host arena fetched KV waits in (worker/host_staging.py): regions come back when
their holder is garbage, a fetch waits for room (bounded), and a prompt larger than the arena
loads only its leading chunks (real Redis, real LMCache)."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.worker.test_kv_store import run_peer
from tests.worker.test_kv_store_fetch import store_48
from worker.host_staging import HostStaging


def test_regions_are_disjoint_and_come_back_when_dropped() -> None:
    arena = HostStaging(5 * 4096, pin=False)
    a, b = arena.take(4096, 0), arena.take(3 * 4096 - 5, 0)  # rounded up to whole pages
    assert a is not None and b is not None and arena.free_bytes == 4096
    a.data.fill_(1)
    b.data.fill_(2)
    assert int(a.data.sum()) == 4096  # b's bytes did not land on a's
    assert arena.take(2 * 4096, 0) is None  # no room, and no wait asked for
    del a
    gc.collect()
    assert arena.free_bytes == 2 * 4096
    del b
    gc.collect()
    assert arena.free_bytes == 5 * 4096
    whole = arena.take(5 * 4096, 0)  # the freed pieces merged back into one
    assert whole is not None and whole.data.numel() == 5 * 4096


def test_a_take_waits_for_room_then_gives_up_at_its_deadline() -> None:
    arena = HostStaging(2 * 4096, pin=False)
    held = [arena.take(2 * 4096, 0)]

    def release() -> None:
        time.sleep(0.3)
        held.clear()
        gc.collect()

    t = threading.Thread(target=release)
    t.start()
    started = time.monotonic()
    got = arena.take(4096, 5.0)
    t.join()
    assert got is not None and 0.2 < time.monotonic() - started < 4.0
    started = time.monotonic()
    assert arena.take(2 * 4096, 0.2) is None  # `got` still holds a page
    assert time.monotonic() - started >= 0.2


def test_a_region_larger_than_the_arena_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than"):
        HostStaging(4096, pin=False).take(4097, 0)


def test_a_prompt_larger_than_the_arena_loads_its_leading_chunks(redis_url: str,
                                                                 tmp_path: Path) -> None:
    tokens = [5 * i % 900 + 1 for i in range(48)]  # 3 chunks of 16 tokens, 9,216 B each
    kv, _ = store_48(tmp_path, redis_url, tokens, 9)
    got = run_peer(tmp_path, "small", redis_url, [
        {"kind": "fetch", "name": "small", "tokens": tokens, "arena_bytes": 5 * 4096}])
    assert got["small"] == 32  # two chunks (18,432 B) fit in 20,480 B, three do not
    assert torch.equal(got["small.kv"], kv[:, :, :32])
    got = run_peer(tmp_path, "whole", redis_url, [{"kind": "fetch", "name": "whole", "tokens": tokens}])
    assert got["whole"] == 48 and torch.equal(got["whole.kv"], kv)


def test_pinning_is_honoured_only_where_there_is_a_device_to_pin_for(
        caplog: pytest.LogCaptureFixture) -> None:
    staging = HostStaging(1 << 20, pin=True)
    region = staging.take(4096, timeout_s=0)
    assert region is not None
    if torch.cuda.is_available():
        assert staging.pinned and region.data.is_pinned()
    else:
        assert not staging.pinned and "stays pageable" in caplog.text
