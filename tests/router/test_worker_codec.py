"""router/worker_codec.py: the router's dataclasses <-> bulkhead.v1 messages."""

from __future__ import annotations

from proto import bulkhead_pb2 as pb
from router.worker_codec import (
    KVHandle,
    Prefilled,
    Sampling,
    WorkItem,
    chunk_from_proto,
    generate_request,
    prefill_request,
    prefilled_from_proto,
)

ITEM = WorkItem("r-1", (3, 1, 4), Sampling(max_tokens=5, temperature=0.0, top_k=2,
                                          stop_token_ids=(9,), seed=0), deadline_unix_s=12.5)


def test_prefill_request_carries_every_field() -> None:
    msg = prefill_request(ITEM)
    assert (msg.request_id, list(msg.prompt_token_ids), msg.deadline_unix_s) == (
        "r-1", [3, 1, 4], 12.5)
    assert msg.sampling.max_tokens == 5 and list(msg.sampling.stop_token_ids) == [9]
    assert msg.sampling.HasField("seed") and msg.sampling.seed == 0  # 0 is a seed, not unset
    assert not prefill_request(WorkItem("r", (1,), Sampling(1))).sampling.HasField("seed")


def test_prefill_response_round_trips_into_the_generate_that_continues_it() -> None:
    resp = pb.PrefillResponse(request_id="r-1", first_token_id=7, num_cached_tokens=2,
                              num_computed_tokens=1, finish_reason="",
                              kv=pb.KVHandle(num_tokens_stored=3, kv_layout_fingerprint="L",
                                             store_url="redis://h:1"))
    prefilled = prefilled_from_proto(resp)
    assert prefilled == Prefilled(7, None, 2, 1, KVHandle(3, "L", "redis://h:1"))
    gen = generate_request(ITEM, prefilled)
    assert gen.has_prefill and gen.first_token_id == 7
    assert (gen.kv.num_tokens_stored, gen.kv.kv_layout_fingerprint) == (3, "L")
    assert not generate_request(ITEM).has_prefill


def test_chunks_carry_usage_only_when_the_worker_sent_it() -> None:
    assert chunk_from_proto(pb.GenerateChunk(token_ids=[1, 2])).usage is None
    last = chunk_from_proto(pb.GenerateChunk(
        token_ids=[3], finish_reason="length",
        usage=pb.Usage(cached_tokens=4, loaded_kv_tokens=5, recomputed_tokens=6)))
    assert last.token_ids == (3,) and last.finish_reason == "length"
    assert last.usage is not None and (last.usage.cached_tokens, last.usage.loaded_kv_tokens,
                                       last.usage.recomputed_tokens) == (4, 5, 6)
