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

import torch

from common.redact import redact_url
from common.worker_env import WORKER_ENV

# Bumped whenever the bytes we hand LMCache change meaning (order of K/V, layers, heads).
_LAYOUT_VERSION = "bulkhead-kv-2LTD-v1"
_SCHEMES = ("redis", "rediss", "lm")
REDIS_SCHEMES = ("redis", "rediss")



def layout_fingerprint(model_name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, chunk_size: int) -> str:
    """Hash of everything that decides what the stored bytes mean and how they are keyed
    (not where they live, and not the engine's block size: the connector re-pages)."""
    desc = "|".join(str(x) for x in (_LAYOUT_VERSION, model_name, num_layers, num_kv_heads,
                                     head_dim, str(dtype).removeprefix("torch."), chunk_size))
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
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_size: int = 256
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
        for name in ("num_layers", "num_kv_heads", "head_dim", "chunk_size"):
            if getattr(self, name) < 1:
                raise KVStoreError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.staging_gb <= 0:
            raise KVStoreError(f"staging_gb must be > 0 (LMCache's staging pool), got "
                               f"{self.staging_gb}")

    @property
    def layout_fingerprint(self) -> str:
        return layout_fingerprint(self.model_name, self.num_layers, self.num_kv_heads,
                                  self.head_dim, self.dtype, self.chunk_size)
