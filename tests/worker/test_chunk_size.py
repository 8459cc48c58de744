"""The LMCache chunk a worker picks when none is set (worker/kv_store_config.auto_chunk_tokens):
whole blocks, at most 256 tokens, sized so that Redis keeps each chunk with little allocator
rounding. Checked against a real redis-server's own accounting of what it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch

from tests.helpers.kv_layouts import llama_kv_layout
from worker.kv_store_config import auto_chunk_tokens

MIB = 2**20
# Llama-3-8B's KV geometry: 32 layers x 8 KV heads x 128, bf16 -> 128 KiB a token
LLAMA3_8B_KV = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128}


@pytest.mark.parametrize("block_size,bytes_per_block,want", [
    (16, 2 * MIB, 240),  # Llama-3-8B bf16: 256 tokens are exactly 32 MiB, held in 40
    (16, 16 * 36 * 8 * 128 * 2 * 2, 224),  # 36 layers: 224 tokens, 31.5 MiB, fill 32 MiB
    (32, 4 * MIB, 224),  # the same model in blocks of 32: 240 is not whole blocks
    (256, 4532 * 256, 256),  # DeepSeek-V4 (blocks of 256): one block is the only choice
    (512, 1000, 512),  # a block larger than the cap is the chunk
    (1, 128 * 1024, 255),
])
def test_the_chunk_is_whole_blocks_within_the_cap_with_the_least_rounding(
        block_size: int, bytes_per_block: int, want: int) -> None:
    got = auto_chunk_tokens(block_size, bytes_per_block)
    assert got == want
    assert got % block_size == 0 and (got <= 256 or got == block_size)


def test_redis_holds_an_auto_sized_chunk_in_little_more_than_its_bytes(
        redis_url: str, tmp_path: Path) -> None:
    # Stores two prompts of Llama-3-8B's KV geometry (128 KiB a token) through LMCache into the
    # real Redis, one in 256-token chunks and one in the chosen size, and asks Redis what each
    # chunk's value costs it (MEMORY USAGE: the allocation jemalloc gave, which maxmemory counts).
    from worker.kv_store import KVStore

    client = redis.Redis.from_url(redis_url)
    if not str(client.info("memory").get("mem_allocator", "")).startswith("jemalloc"):
        pytest.skip("the size classes measured here are jemalloc's")
    layout = llama_kv_layout(tmp_path, **LLAMA3_8B_KV)
    auto = auto_chunk_tokens(layout.block_size, layout.bytes_per_block)
    assert auto == 240
    cost = {}
    for i, chunk in enumerate((256, auto)):
        tokens = [50_000 * (i + 1) + t for t in range(2 * chunk)]
        blocks = len(tokens) // layout.block_size
        kv = layout.allocate(blocks + 1, torch.device("cpu"))
        store = KVStore(redis_url, f"chunk-cost-{chunk}", layout, chunk_size=chunk,
                        staging_gb=2 * chunk * 128 * 1024 / 2**30 + 0.1, ttl_s=60)
        try:
            store.put(tokens, kv, list(range(1, blocks + 1)))
            assert store.wait_visible(tokens, timeout_s=60) == len(tokens)
            keys = [k + "kv_bytes" for _, _, k in store.chunk_keys(tokens)]
        finally:
            store.close()
        sizes = [(client.strlen(k), client.memory_usage(k)) for k in keys]
        assert all(n == chunk * 128 * 1024 for n, _ in sizes)
        cost[chunk] = max(used / n for n, used in sizes)
        client.delete(*keys)
    assert cost[256] >= 1.2  # 32 MiB held in 40 MiB
    assert cost[auto] <= 1.07  # 30 MiB held in 32 MiB
