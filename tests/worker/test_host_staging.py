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


def test_a_trimmed_region_keeps_its_head_and_gives_its_tail_back() -> None:
    arena = HostStaging(6 * 4096, pin=False)
    region = arena.take(5 * 4096, 0)
    assert region is not None and arena.free_bytes == 4096
    region.data.fill_(7)
    arena.trim(region, 4096 + 10)  # rounded up to whole pages: two kept
    assert region.data.numel() == 4096 + 10 and int(region.data.sum()) == 7 * (4096 + 10)
    assert arena.free_bytes == 4 * 4096
    other = arena.take(4 * 4096, 0)  # the tail and the untaken page merged
    assert other is not None
    del region
    gc.collect()
    assert arena.free_bytes == 2 * 4096  # the kept head came back once, not twice
    del other
    gc.collect()
    gone = arena.take(4096, 0)
    assert gone is not None and gone._release is not None
    gone._release()  # given back already: trimming it would give its bytes back twice
    with pytest.raises(ValueError, match="released"):
        arena.trim(gone, 1)


class _ReaderThatLosesChunks:
    """A store whose lookup sees every chunk and whose read loses them from ``lose_from`` on:
    Redis evicting a handoff between the two round trips."""

    def __init__(self, chunk_bytes: int, lose_from: int) -> None:
        self.chunk_bytes, self.lose_from = chunk_bytes, lose_from

    def stored_lengths(self, keys: list[str]) -> list[int]:
        return [self.chunk_bytes] * len(keys)

    def read(self, keys: list[str], dests: list[memoryview]) -> int:
        for d in dests[: self.lose_from]:
            d[:] = b"\x05" * len(d)
        return min(self.lose_from, len(keys))


def test_a_fetch_that_loses_chunks_to_eviction_frees_the_room_it_did_not_fill(
        caplog: pytest.LogCaptureFixture) -> None:
    from worker.kv_store_config import KVStoreConfig
    from worker.staged_fetch import fetch_staged

    cfg = KVStoreConfig(url="redis://127.0.0.1:1", model_name="m", engine_layout="l",
                        block_size=16, bytes_per_block=4096, chunk_size=32)
    per_chunk = 2 * cfg.padded_block_bytes
    chunks = [(32 * i, 32 * (i + 1), f"k{i}") for i in range(4)]
    arena = HostStaging(4 * per_chunk, pin=False)
    loaded, staged, region = fetch_staged(_ReaderThatLosesChunks(per_chunk, 1), cfg, chunks,
                                          arena, 0)
    assert loaded == 32 and staged is not None and staged.shape[0] == 2
    assert int(staged.float().mean()) == 5
    assert arena.free_bytes == 3 * per_chunk  # not held for the three chunks it never read
    assert "1 of 4 stored chunks read" in caplog.text
    del staged, region
    gc.collect()
    assert arena.free_bytes == 4 * per_chunk
