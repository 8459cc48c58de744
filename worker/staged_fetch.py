"""A prompt's stored chunks, looked up and read from Redis into a host staging tensor without
going through LMCache's engine (worker/redis_chunk_reader.py says why).

``KVStore`` uses it for ``lookup``/``fetch`` when its store is Redis; the bytes are the ones
LMCache wrote through our ``BlockConnector``: ``num_blocks x padded_block_bytes`` per chunk, of
which each block's first ``bytes_per_block`` are the layout's export. Host memory only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.kv_store_config import KVStoreConfig
from worker.redis_chunk_reader import RedisChunkReader

Chunk = tuple[int, int, str]  # (start, end, LMCache key) of one chunk of a prompt's tokens


def chunk_bytes(cfg: KVStoreConfig, start: int, end: int) -> int:
    """What LMCache stores for the tokens ``[start, end)`` (whole blocks, padding included)."""
    return (end - start) // cfg.block_size * cfg.padded_block_bytes


def stored_chunks(reader: RedisChunkReader, cfg: KVStoreConfig,
                  chunks: Sequence[Chunk]) -> list[Chunk]:
    """The leading chunks the store holds in full, of the size our layout stores (one round
    trip; a chunk of another size, which a peer with another layout would have written under
    another key anyway, ends the prefix)."""
    lengths = reader.stored_lengths([k for _, _, k in chunks])
    n = 0
    while n < len(lengths) and lengths[n] == chunk_bytes(cfg, *chunks[n][:2]):
        n += 1
    return list(chunks[:n])


def fetch_staged(reader: RedisChunkReader, cfg: KVStoreConfig,
                 chunks: Sequence[Chunk]) -> tuple[int, torch.Tensor | None]:
    """Read the stored prefix of ``chunks`` (a prompt's, from token 0) into a new host tensor.

    Returns ``(num_tokens, staged)``, staged: [num_blocks, bytes_per_block] uint8 (a view that
    skips each block's padding, if the layout pads), one row per block of the tokens read;
    ``(0, None)`` when nothing is stored."""
    present = stored_chunks(reader, cfg, chunks)
    if not present:
        return 0, None
    bs, padded = cfg.block_size, cfg.padded_block_bytes
    raw = torch.empty(present[-1][1] // bs, padded, dtype=torch.uint8)
    flat = raw.view(-1).numpy()  # memoryviews of it are what recv_into fills
    dests = [memoryview(flat[s // bs * padded: e // bs * padded]) for s, e, _ in present]
    num_read = reader.read([k for _, _, k in present], dests)
    if not num_read:
        return 0, None
    end = present[num_read - 1][1]
    return end, raw[: end // bs, : cfg.bytes_per_block]
