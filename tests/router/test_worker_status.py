"""router/worker_status.py: WorkerInfo from GetInfo and from a registry value becomes the same
plain values, every field carried, and junk in Redis is refused rather than half-read."""

from __future__ import annotations

from dataclasses import fields

from proto import bulkhead_pb2 as pb
from router.worker_status import Compat, WorkerStatus, status_from_bytes, status_from_proto


def _message() -> pb.WorkerInfo:
    compat = pb.Compatibility(model_fingerprint="m", tokenizer_fingerprint="t", dtype="bf16",
                              block_size=256, lmcache_chunk_size=512, kv_layout_fingerprint="k")
    return pb.WorkerInfo(worker_id="w1", role="decode", model_name="tiny", compat=compat,
                         max_context=1 << 20, chunk_tokens=4096, max_batch=4, num_running=3,
                         num_waiting=2, max_queue=64, free_kv_tokens=10**9,
                         memory_planned_bytes=7, memory_headroom_bytes=8, steps_completed=11,
                         tokens_advanced=12, address="h:1", total_kv_tokens=2 * 10**9)


def test_every_proto_field_is_carried() -> None:
    # a field added to the proto but not here would silently read as its default
    assert {f.name for f in pb.WorkerInfo.DESCRIPTOR.fields} == {f.name for f in fields(WorkerStatus)}
    assert {f.name for f in pb.Compatibility.DESCRIPTOR.fields} == {f.name for f in fields(Compat)}
    s = status_from_proto(_message())
    assert (s.free_kv_tokens, s.total_kv_tokens, s.max_context) == (10**9, 2 * 10**9, 1 << 20)
    assert s.compat.key() == ("m", "t", "bf16", 256, 512, "k")
    assert status_from_bytes(_message().SerializeToString()) == s


def test_compat_diff_names_the_field() -> None:
    a = status_from_proto(_message()).compat
    b = Compat(**{**{f.name: getattr(a, f.name) for f in fields(a)}, "block_size": 16})
    assert a.diff(b) == ["block_size: 256 != 16"] and a.diff(a) == []


def test_junk_is_not_a_worker() -> None:
    assert status_from_bytes(b"\xff\xff\xff not a proto") is None
