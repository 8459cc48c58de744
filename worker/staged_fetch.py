"""A prompt's stored chunks, looked up and read from Redis into a host staging tensor without
going through LMCache's engine (worker/redis_chunk_reader.py says why).

``KVStore`` uses it for ``lookup``/``fetch`` when its store is Redis; the bytes are the ones
LMCache wrote through our ``BlockConnector``: ``num_blocks x padded_block_bytes`` per chunk, of
which each block's first ``bytes_per_block`` are the layout's export. Host memory only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.host_staging import HostStaging, Region
from worker.kv_store_config import KVStoreConfig
from worker.redis_chunk_reader import RedisChunkReader

log = logging.getLogger(__name__)
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


def fetch_staged(reader: RedisChunkReader, cfg: KVStoreConfig, chunks: Sequence[Chunk],
                 staging: HostStaging, wait_s: float) -> tuple[int, torch.Tensor | None, Region | None]:
    """Read the stored prefix of ``chunks`` (a prompt's, from token 0) into a region of
    ``staging`` (as many leading chunks as the arena holds; waiting up to ``wait_s`` for room).

    Returns ``(num_tokens, staged, region)``, staged: [num_blocks, bytes_per_block] uint8 (a
    view that skips each block's padding, if the layout pads), one row per block of the tokens
    read, inside ``region`` (keep it alive while staged is used); ``(0, None, None)`` when
    nothing is stored or no room came in time."""
    present = stored_chunks(reader, cfg, chunks)
    present = present[:fitting_chunks([chunk_bytes(cfg, s, e) for s, e, _ in present], staging.nbytes)]
    if not present:
        return 0, None, None
    bs, padded = cfg.block_size, cfg.padded_block_bytes
    region = staging.take(present[-1][1] // bs * padded, wait_s)
    if region is None:
        return 0, None, None
    raw = region.data.view(-1, padded)
    flat = raw.view(-1).numpy()  # memoryviews of it are what recv_into fills
    dests = [memoryview(flat[s // bs * padded: e // bs * padded]) for s, e, _ in present]
    num_read = reader.read([k for _, _, k in present], dests)
    if not num_read:
        return 0, None, None
    end = present[num_read - 1][1]
    if num_read < len(present):
        # present at the lookup, gone at the read: the store evicted them (Redis at its
        # maxmemory) or a read failed; the engine computes the rest of the prompt
        log.warning("KV fetch: %d of %d stored chunks read (tokens %d-%d lost between lookup "
                    "and read: evicted by the store, or a failed read); the rest is computed",
                    num_read, len(present), end, present[-1][1])
        staging.trim(region, end // bs * padded)
        raw = region.data.view(-1, padded)
    return end, raw[: end // bs, : cfg.bytes_per_block], region


def fitting_chunks(sizes: Sequence[int], capacity: int) -> int:
    """How many leading chunks of these byte sizes fit together in ``capacity`` bytes."""
    total = n = 0
    for size in sizes:
        if total + size > capacity:
            break
        total += size
        n += 1
    return n


def staged_blocks(staging: HostStaging, cfg: KVStoreConfig, tokens: list[int],
                  wait_s: float) -> tuple[list[int], torch.Tensor | None, Region | None]:
    """For a read through LMCache's engine (an ``lm://`` store): the leading whole chunks of
    ``tokens`` that fit the arena, and a [num_blocks, bytes_per_block] region for them, or
    ``(tokens, None, None)`` when there is nothing to read or no room came within ``wait_s``."""
    per_chunk = cfg.chunk_size // cfg.block_size * cfg.bytes_per_block
    tokens = tokens[:staging.nbytes // per_chunk * cfg.chunk_size]
    num_blocks = len(tokens) // cfg.block_size
    region = staging.take(num_blocks * cfg.bytes_per_block, wait_s) if num_blocks else None
    if region is None:
        return tokens, None, None
    return tokens, region.data.view(num_blocks, cfg.bytes_per_block), region
