"""The engine's per-request queue and prefill times (vLLM's request_queue_time_seconds and
request_prefill_time_seconds), on the finishing output: with one slot, the second request waits
for the whole first one."""

from __future__ import annotations

import time

from engine.sampling_params import SamplingParams
from tests.engine.conftest import saved_tiny_model
from tests.engine.test_engine_vs_transformers import make_engine


def test_queue_and_prefill_times(tmp_path_factory) -> None:
    _, folder = saved_tiny_model(tmp_path_factory, "qwen2", "qwen2-times")
    engine = make_engine(folder, max_context=256, chunk_tokens=32, max_batch=1)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    engine.add_request("a", list(range(5, 60)), sp)
    engine.add_request("b", list(range(5, 20)), sp)
    finished = {}
    ended = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
                ended[o.request_id] = time.monotonic() - started
    a, b = finished["a"], finished["b"]
    assert 0 <= a.queue_time_s < b.queue_time_s
    assert a.prefill_time_s > 0 and b.prefill_time_s > 0
    # b was admitted only once a had finished: it queued for about all of a's run
    assert b.queue_time_s >= ended["a"] * 0.8
    assert a.queue_time_s + a.prefill_time_s <= ended["a"]
