"""The scheduler on plain data: no tensors, a real block pool."""

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence


def make(num_blocks=64, block_size=4, max_batch=4, chunk=8, max_context=64, eos=(0,)):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_batch, chunk, max_context, eos), bm), bm


def seq(rid, n, arrival, max_tokens=4, first=1):
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens,
                                                               temperature=0), arrival)


def run_step(s, token=5):
    out = s.schedule()
    sampled = {c.request_id: token for c in out.chunks if c.do_sample}
    return out, s.update_from_output(out, sampled)


def test_chunked_prefill_respects_token_budget_and_samples_at_end():
    s, _ = make(chunk=8)
    s.add(seq("a", 19, 0))
    sizes = []
    for _ in range(3):
        out, ups = run_step(s)
        sizes.append([(c.start, c.num_tokens, c.do_sample) for c in out.chunks])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 3, True)]]
    assert ups[0].new_token_ids == (5,)


def test_decodes_batched_with_prefill_and_decodes_go_first():
    s, _ = make(chunk=8)
    s.add(seq("a", 3, 0))
    run_step(s)  # a prefilled, one token sampled
    s.add(seq("b", 20, 1))
    out, _ = run_step(s)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_finish_on_eos_and_length_frees_blocks():
    s, bm = make()
    free0 = bm.num_free_blocks
    s.add(seq("a", 3, 0, max_tokens=2))
    _, ups = run_step(s, token=5)
    assert not ups[0].finished
    _, ups = run_step(s, token=5)
    assert ups[0].finished and ups[0].finish_reason == "length"
    assert bm.num_free_blocks == free0 and not s.has_unfinished()
    s.add(seq("b", 3, 1, max_tokens=10))
    _, ups = run_step(s, token=0)
    assert ups[0].finish_reason == "stop"


def test_max_batch_bounds_running():
    s, _ = make(max_batch=2, chunk=100)
    for i in range(3):
        s.add(seq(f"r{i}", 3, i))
    out = s.schedule()
    assert len(out.chunks) == 2 and len(s.waiting) == 1


def test_preemption_when_pool_is_dry_recomputes_latest_arrival():
    # 6 usable blocks of 4 tokens; two sequences of 9 tokens take 3 blocks each (prompt + 1).
    s, bm = make(num_blocks=7, block_size=4, chunk=100, max_batch=4)
    s.add(seq("a", 9, 0, max_tokens=10))
    s.add(seq("b", 9, 1, max_tokens=10, first=100))  # no prefix shared with a
    run_step(s)
    assert bm.num_free_blocks == 0
    # each now holds 10 tokens and needs its 4th block at token 13: run until one is preempted
    preempted = []
    for _ in range(5):
        out, _ = run_step(s)
        preempted += out.preempted
        if preempted:
            break
    assert preempted == ["b"]
    assert [c.request_id for c in out.chunks] == ["a"]
    b = s.waiting[0]
    assert b.request_id == "b" and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids and not b.block_ids
    # b comes back once a finishes, recomputing prompt + outputs so far
    for _ in range(20):
        out, ups = run_step(s)
        if any(c.request_id == "b" for c in out.chunks):
            break
    last = out.chunks[-1]
    # recomputed from its longest surviving cached prefix, outputs included
    assert last.request_id == "b" and last.start % 4 == 0 and last.start < 9
    # (b has since sampled one more token from this chunk)
    assert last.start + last.num_tokens == 9 + len(b.output_token_ids) - 1 and last.do_sample


def test_abort_waiting_and_running():
    s, bm = make()
    free0 = bm.num_free_blocks
    s.add(seq("a", 3, 0))
    s.add(seq("b", 3, 1))
    run_step(s)
    assert s.abort("a").finish_reason == "abort"
    assert s.abort("b") is not None
    assert s.abort("zzz") is None
    assert bm.num_free_blocks == free0 and not s.has_unfinished()


def test_step_context_limit_defers_chunks_not_decodes():
    """max_step_context (a family whose step gathers every chunk's history, DeepSeek-V4): the
    multi-token chunks of one step reach at most that much context together. The first chunk
    always runs; a chunk past the limit waits for the next step (a waiting prompt is admitted,
    its first chunk deferred, and later arrivals wait behind it); one-token decodes gather
    nothing and are never held back."""
    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(4, 32, 64, (0,), max_step_context=20), bm)
    for rid, arrival in (("a", 0), ("b", 1), ("c", 2)):
        s.add(seq(rid, 12, arrival, first=1 + 100 * arrival))  # no shared prefix
    out, _ = run_step(s)
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 0, 12)]
    assert out.admitted == ["a", "b"]  # b holds its slot; c waits in the queue
    out, _ = run_step(s)
    # a decodes (one token), b's chunk runs alone among the chunks, c's would pass 20
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 12)]
    assert out.chunks[1].is_first
    out, _ = run_step(s)
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 12)]
    # without the limit all three prompts share the first step
    s2, _ = make(chunk=40, max_context=64)
    for rid, arrival in (("a", 0), ("b", 1), ("c", 2)):
        s2.add(seq(rid, 12, arrival))
    assert len(s2.schedule().chunks) == 3


def test_restart_rejected_verify_recomputes_the_kept_tokens():
    """With restart_rejected_verify (a family that puts its state back to a verify chunk's
    start): a rejecting verify step counts none of its positions as computed, and the next
    chunk starts there again with the kept tokens and no drafts; a fully accepted one counts
    all of them, as without the flag."""
    bm = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(4, 16, 64, (0,), restart_rejected_verify=True), bm)
    s.add(Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, temperature=0), 0))
    run_step(s, token=6)  # prefill: tokens 1..6, 5 computed
    seq_a = s.running[0]
    seq_a.draft_token_ids = [7, 8, 9]
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.token_ids, chunk.num_draft_tokens) == (5, (6, 7, 8, 9), 3)
    s.update_from_output(out, {"a": [7, 11]})  # draft 7 kept, 8 rejected: 11 instead
    assert seq_a.num_computed_tokens == 5 and seq_a.output_token_ids == [6, 7, 11]
    out = s.schedule()  # the drafter proposes only with one uncomputed token: none here
    (chunk,) = out.chunks
    assert (chunk.start, chunk.token_ids, chunk.num_draft_tokens) == (5, (6, 7, 11), 0)
    s.update_from_output(out, {"a": 12})
    assert seq_a.num_computed_tokens == 8
    seq_a.draft_token_ids = [13, 14]
    out = s.schedule()
    s.update_from_output(out, {"a": [13, 14, 15]})  # all kept
    assert seq_a.num_computed_tokens == 11 and seq_a.output_token_ids[-3:] == [13, 14, 15]
