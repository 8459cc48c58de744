"""What a KV store is built from, and what both sides of a handoff must agree on.

``KVStoreConfig`` is checked at construction (URL scheme, host and port, positive shapes, TTL);
``layout_fingerprint`` hashes everything that decides what the stored bytes mean, so a router can
refuse to pair workers whose stores would read each other's chunks as garbage. Nothing here
imports LMCache or opens a connection: that is ``worker.kv_store.KVStore``'s job.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from common.redact import redact_url
from common.worker_env import WORKER_ENV

# Bumped whenever the way blocks are packed into LMCache's memory objects changes; what a
# block's bytes mean is the engine layout's own fingerprint, hashed in too.
_LAYOUT_VERSION = "bulkhead-kv-blocks-v1"
_SCHEMES = ("redis", "rediss", "lm")
REDIS_SCHEMES = ("redis", "rediss")



def padded_block_bytes(block_size: int, bytes_per_block: int) -> int:
    """A block's bytes rounded up to fill whole token rows of LMCache's memory object."""
    unit = 2 * block_size
    return -(-bytes_per_block // unit) * unit


def _jemalloc_bytes(nbytes: int) -> int:
    """What jemalloc (Redis's allocator) hands out for ``nbytes``: above 16 KiB, four size
    classes in each doubling (2^k, 1.25, 1.5, 1.75 x 2^k)."""
    if nbytes <= 16384:
        return -(-nbytes // 4096) * 4096
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


# A Redis string's bytes beyond its value: the sds header, its terminator, and the "\r\n" the
# query buffer it was read into keeps (a bulk argument becomes the value without a copy)
_REDIS_VALUE_EXTRA = 64


def auto_chunk_tokens(block_size: int, bytes_per_block: int, most: int = 256) -> int:
    """The LMCache chunk (tokens) a worker uses when none is set: of the whole-block sizes in
    ``(most / 2, most]``, the one whose stored value Redis keeps with the least rounding, the
    largest among equals; ``block_size`` itself if it is larger than ``most``.

    Why: Redis keeps each chunk as one string in an allocation of jemalloc's next size class,
    and counts that against ``maxmemory``. A chunk of exactly 32 MiB (256 tokens of
    Llama-3-8B) is held in 40 MiB, so 25% of the store is padding and evicts handoffs before
    they are read (H200, 2026-12-04); 240 tokens (30 MiB) are held in 32 MiB (lab/results/notebook.md)."""
    if block_size >= most:
        return block_size
    row = padded_block_bytes(block_size, bytes_per_block)
    best, best_ratio = most - most % block_size, float("inf")
    for blocks in range(most // block_size, 0, -1):
        tokens = blocks * block_size
        if 2 * tokens <= most:
            break
        value = blocks * row
        ratio = _jemalloc_bytes(value + _REDIS_VALUE_EXTRA) / value
        if ratio < best_ratio - 1e-9:
            best, best_ratio = tokens, ratio
    return best


def layout_fingerprint(model_name: str, engine_layout: str, block_size: int,
                       bytes_per_block: int, chunk_size: int) -> str:
    """Hash of everything that decides what the stored bytes mean and how they are keyed:
    the model, the engine's KV layout (``KVLayout.fingerprint``: family, shapes, dtype, block
    geometry), the block and chunk sizes (not where the blocks live)."""
    desc = "|".join(str(x) for x in (_LAYOUT_VERSION, model_name, engine_layout, block_size,
                                     bytes_per_block, chunk_size))
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


class KVStoreError(Exception):
    """The KV store could not be set up or used (bad URL, backend unreachable, bad shapes)."""


def worker_environment() -> dict[str, str]:
    """Environment every process that computes LMCache keys must start with."""
    return dict(WORKER_ENV)


@dataclass(frozen=True)
class KVStoreConfig:
    """What both sides of a handoff must agree on, plus local knobs (staging, timeouts)."""

    url: str = field(repr=False)  # redis[s]://[:password@]host:port[/db][?...] or lm://host:port
    model_name: str
    engine_layout: str  # the engine's KVLayout.fingerprint
    block_size: int  # tokens per block
    bytes_per_block: int
    chunk_size: int = 256  # tokens per LMCache chunk: a multiple of block_size
    staging_gb: float = 0.5  # LMCache's CPU staging pool (allocated and zero-filled at start)
    blocking_timeout_s: int = 10  # LMCache's own timeout for a blocking remote get
    ttl_s: int = 3600  # expiry of every chunk key in a Redis store; 0 = never

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise KVStoreError(
                f"kv store url {redact_url(self.url)!r}: scheme must be one of "
                f"{', '.join(s + '://' for s in _SCHEMES)}"
            )
        parts = urlsplit(self.url)
        if not parts.hostname or not parts.port:
            raise KVStoreError(f"kv store url {redact_url(self.url)!r} needs host and port")
        if self.ttl_s < 0:
            raise KVStoreError(f"ttl_s must be >= 0 (0 = no expiry), got {self.ttl_s}")
        for name in ("block_size", "bytes_per_block", "chunk_size"):
            if getattr(self, name) < 1:
                raise KVStoreError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size % self.block_size:
            raise KVStoreError(f"lmcache chunk_size={self.chunk_size} must be a multiple of the "
                               f"engine's block_size={self.block_size}: chunks hold whole blocks")
        if self.staging_gb <= 0:
            raise KVStoreError(f"staging_gb must be > 0 (LMCache's staging pool), got "
                               f"{self.staging_gb}")

    @property
    def layout_fingerprint(self) -> str:
        return layout_fingerprint(self.model_name, self.engine_layout, self.block_size,
                                  self.bytes_per_block, self.chunk_size)

    @property
    def padded_block_bytes(self) -> int:
        """A block's bytes rounded up to fill whole token rows of LMCache's memory object."""
        return padded_block_bytes(self.block_size, self.bytes_per_block)

    @property
    def token_row_bytes(self) -> int:
        """Bytes per token in each (K, V) half of LMCache's [2, 1, tokens, row] uint8 object."""
        return self.padded_block_bytes // (2 * self.block_size)
