"""The routing policy as a function: split or not, least-loaded, compatibility, context limits."""

from __future__ import annotations

import dataclasses

from router.policy import (
    Refusal,
    Route,
    RoutePolicy,
    RouteRequest,
    WorkerLoad,
    choose_route,
    needs_lookup,
)

KEY = ("m", "t", "bf16", 16, 256, "kv")
POLICY = RoutePolicy(split_threshold_tokens=256)


def worker(address: str, role: str, **kw: object) -> WorkerLoad:
    base = dict(address=address, role=role, max_context=4096, max_batch=8, max_queue=16,
                num_running=0, num_waiting=0, num_inflight=0, free_kv_tokens=10_000,
                compat_key=KEY, healthy=True)
    base.update(kw)
    return WorkerLoad(**base)  # type: ignore[arg-type]


def test_short_prompt_stays_on_decode() -> None:
    r = choose_route(RouteRequest(255, 16), [worker("p", "prefill"), worker("d", "decode")],
                     POLICY)
    assert isinstance(r, Route) and r.kind == "decode" and r.prefill_address is None


def test_threshold_counts_uncached_tokens_only() -> None:
    workers = [worker("p", "prefill"), worker("d", "decode")]
    split = choose_route(RouteRequest(1000, 16, num_cached_tokens=744), workers, POLICY)
    assert isinstance(split, Route) and split.kind == "split" and split.prefill_address == "p"
    stay = choose_route(RouteRequest(1000, 16, num_cached_tokens=745), workers, POLICY)
    assert isinstance(stay, Route) and stay.kind == "decode"


def test_least_loaded_workers_are_chosen() -> None:
    workers = [worker("p1", "prefill", num_running=3), worker("p2", "prefill", num_running=1),
               worker("d1", "decode", num_running=2, num_waiting=2),
               worker("d2", "decode", num_inflight=3), worker("d3", "decode", num_running=1)]
    r = choose_route(RouteRequest(300, 8), workers, POLICY)
    assert isinstance(r, Route)
    assert (r.decode_address, r.prefill_address) == ("d3", "p2")


def test_load_is_relative_to_batch_and_ties_prefer_free_kv() -> None:
    workers = [worker("a", "decode", num_running=4, max_batch=8),
               worker("b", "decode", num_running=2, max_batch=2),
               worker("c", "decode", num_running=4, max_batch=8, free_kv_tokens=20_000)]
    r = choose_route(RouteRequest(10, 8), workers, POLICY)
    assert isinstance(r, Route) and r.decode_address == "c"


def test_incompatible_prefill_is_never_paired() -> None:
    other = ("m", "t", "fp32", 16, 256, "kv")
    workers = [worker("p_bad", "prefill", compat_key=other), worker("d", "decode")]
    r = choose_route(RouteRequest(1000, 16), workers, POLICY)
    # no compatible prefill worker: the decode worker prefills the prompt itself
    assert isinstance(r, Route) and r.kind == "decode" and r.decode_address == "d"
    workers.append(worker("p_ok", "prefill", num_running=7))
    r = choose_route(RouteRequest(1000, 16), workers, POLICY)
    assert isinstance(r, Route) and r.prefill_address == "p_ok"


def test_pairing_moves_to_a_decode_worker_with_a_compatible_prefill() -> None:
    other = ("m2", "t", "bf16", 16, 256, "kv")
    workers = [worker("d_idle", "decode", compat_key=other), worker("d_busy", "decode",
               num_running=5), worker("p", "prefill")]
    r = choose_route(RouteRequest(1000, 16), workers, POLICY)
    assert isinstance(r, Route) and (r.kind, r.decode_address) == ("split", "d_busy")


def test_context_over_every_plan_is_refused_with_the_largest_limit() -> None:
    workers = [worker("d1", "decode", max_context=1024), worker("d2", "decode", max_context=2048)]
    r = choose_route(RouteRequest(2000, 49), workers, POLICY)
    assert isinstance(r, Refusal) and r.reason == "context_length_exceeded" and r.limit == 2048
    ok = choose_route(RouteRequest(2000, 48), workers, POLICY)
    assert isinstance(ok, Route) and ok.decode_address == "d2"


def test_prefill_worker_too_small_for_the_prompt_is_skipped() -> None:
    workers = [worker("p_small", "prefill", max_context=512), worker("d", "decode")]
    r = choose_route(RouteRequest(600, 16), workers, POLICY)
    assert isinstance(r, Route) and r.kind == "decode"


def test_full_queues_and_missing_workers() -> None:
    full = [worker("d", "decode", max_queue=2, num_waiting=2)]
    r = choose_route(RouteRequest(10, 8), full, POLICY)
    assert isinstance(r, Refusal) and r.reason == "queue_full"
    unbounded = [dataclasses.replace(full[0], max_queue=0)]
    assert isinstance(choose_route(RouteRequest(10, 8), unbounded, POLICY), Route)
    down = [worker("d", "decode", healthy=False), worker("p", "prefill")]
    r = choose_route(RouteRequest(10, 8), down, POLICY)
    assert isinstance(r, Refusal) and r.reason == "no_decode_worker"


def test_full_prefill_queue_falls_back_to_decode() -> None:
    workers = [worker("p", "prefill", max_queue=1, num_waiting=1), worker("d", "decode")]
    r = choose_route(RouteRequest(1000, 16), workers, POLICY)
    assert isinstance(r, Route) and r.kind == "decode"


def test_lookup_only_when_the_prompt_could_reach_the_threshold() -> None:
    assert not needs_lookup(255, POLICY)
    assert needs_lookup(256, POLICY)
