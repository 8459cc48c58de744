"""What a worker says about itself (GetInfo answers and registry heartbeats), as plain values.

Workers publish a ``bulkhead.v1.WorkerInfo`` message in two places: the GetInfo RPC and their
Redis registry key.  Both are decoded here, once, so that the registry, the Redis discovery and
the stall watch reason about dataclasses and never about proto messages.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from google.protobuf.message import DecodeError

from proto import bulkhead_pb2 as pb


@dataclass(frozen=True)
class Compat:
    """What a prefill and a decode worker must agree on to hand KV over (proto Compatibility)."""

    model_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    dtype: str = ""
    block_size: int = 0
    lmcache_chunk_size: int = 0
    kv_layout_fingerprint: str = ""

    def key(self) -> tuple[str, str, str, int, int, str]:
        """The policy's pairing key (router/policy.py CompatKey)."""
        return (self.model_fingerprint, self.tokenizer_fingerprint, self.dtype,
                self.block_size, self.lmcache_chunk_size, self.kv_layout_fingerprint)

    def diff(self, other: Compat) -> list[str]:
        """Fields that differ, as 'field: mine != theirs'."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class WorkerStatus:
    """One worker's identity, limits, load and progress counters at one moment."""

    worker_id: str = ""
    role: str = ""
    model_name: str = ""
    address: str = ""
    compat: Compat = Compat()
    max_context: int = 0
    chunk_tokens: int = 0
    max_batch: int = 0
    max_queue: int = 0
    num_running: int = 0
    num_waiting: int = 0
    free_kv_tokens: int = 0
    total_kv_tokens: int = 0
    memory_planned_bytes: int = 0
    memory_headroom_bytes: int = 0
    steps_completed: int = 0   # liveness: these two advance while the engine makes progress
    tokens_advanced: int = 0
    tensor_parallel_size: int = 0  # ranks its engine spans; 0 from a worker older than the field
    num_preemptions: int = 0       # sequences its engine preempted so far
    # speculative decoding counters (vLLM's spec_decode_*; proto WorkerInfo says what each is)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


def _copy(cls: type, msg: object) -> dict[str, object]:
    out = {f.name: getattr(msg, f.name) for f in fields(cls) if f.name != "compat"}
    if "spec_accepted_per_pos" in out:  # a repeated field: a plain tuple here
        out["spec_accepted_per_pos"] = tuple(int(v) for v in msg.spec_accepted_per_pos)  # type: ignore[attr-defined]
    return out


def status_from_proto(msg: pb.WorkerInfo) -> WorkerStatus:
    return WorkerStatus(**_copy(WorkerStatus, msg),  # type: ignore[arg-type]
                        compat=Compat(**_copy(Compat, msg.compat)))  # type: ignore[arg-type]


def status_from_bytes(raw: bytes) -> WorkerStatus | None:
    """A registry value; None when it is not a serialized WorkerInfo."""
    try:
        return status_from_proto(pb.WorkerInfo.FromString(raw))
    except DecodeError:
        return None
