"""The loop of a rank other than 0: load this rank's shard, plan its memory, then run what rank 0
announces (the same forward on its shard, the warm-up, KV block copies) until told to stop.

A follower never schedules, samples or talks to a client: it holds no request state beyond the
KV blocks rank 0 assigns. If rank 0's process goes away it exits at once, so no rank outlives its
worker.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from engine.block_manager import NULL_BLOCK
from engine.config import EngineConfig
from engine.memory_planner import reserve_allocator_slack
from engine.parallel.kv_gather import export_rank_rows, import_rank_resume, import_rank_rows
from engine.parallel.rank_group import RankGroup
from engine.parallel.rank_runner import build_rank_runner, rank_device
from engine.warmup import Warmup

log = logging.getLogger(__name__)


def follower_main(ec: EngineConfig, rank: int, init_file: str, parent_pid: int,
                  num_threads: int) -> None:
    """Entry point of a spawned rank (torch.multiprocessing, ``spawn``)."""
    torch.set_num_threads(num_threads)  # as many as rank 0 was given
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True,
                     name="parent-watch").start()
    device = rank_device(ec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = RankGroup(rank, ec.tensor_parallel_size, device, init_file)
    runner, shard = build_rank_runner(ec, group)
    plan = runner.plan
    log.info("rank %d of %d ready on %s: plan %.1f MiB, %d KV tokens", rank, group.size, device,
             plan.total_bytes / 2**20, plan.kv_tokens)
    try:
        follow(runner, shard, group)
    finally:
        group.close()


def follow(runner, shard, group: RankGroup) -> None:  # noqa: ANN001 - ModelRunner, ShardPlan
    """Run rank 0's commands until ``stop``."""
    cuda = runner.device.type == "cuda"
    while True:
        cmd = group.receive()
        if cmd.op == "stop":
            return
        with torch.inference_mode():
            if cmd.op == "forward":
                chunks, warmup = cmd.args
                with runner.ws.scope():
                    batch = runner.build_batch(chunks)
                    if warmup:
                        batch.slot_mapping.fill_(NULL_BLOCK)
                    runner.model.forward(batch, runner.kv, runner.ws)
                if not warmup:
                    runner.num_steps += 1
                    runner.check_device_allocations()
            elif cmd.op == "prepare_warmup":
                runner.model.prepare_warmup(runner.kv, cmd.args[0])
            elif cmd.op == "lock":
                runner.ws.lock()
            elif cmd.op == "capture":  # the same sizes in the same order as rank 0, meanwhile
                Warmup(runner).capture_graphs()
            elif cmd.op == "graph_step":
                _replay(runner, list(cmd.args[0]))
            elif cmd.op == "reset":
                runner.model.reset(runner.kv)
                if cuda:  # the allocation check on every rank, from the end of the warm-up
                    reserve_allocator_slack(runner.device, runner.plan.term("allocator_slack"))
                    torch.cuda.synchronize(runner.device)
                    runner.device_alloc_baseline = torch.cuda.memory_stats(runner.device).get(
                        "num_device_alloc", 0)
            elif cmd.op == "export":
                export_rank_rows(runner, shard, group, list(cmd.args[0]))
            elif cmd.op == "import":
                import_rank_rows(runner, shard, group, list(cmd.args[0]), None)
            elif cmd.op == "import_resume":
                import_rank_resume(runner, group, int(cmd.args[0]), None)
            else:
                raise RuntimeError(f"rank {group.rank}: unknown command {cmd.op!r}")


def _replay(runner, chunks: list) -> None:  # noqa: ANN001 - ModelRunner, ScheduledChunk
    """Rank 0's graph step on this rank: the same inputs into this rank's static buffers, the
    same graph replayed (its all-reduces meet rank 0's), the family's host bookkeeping around it.
    The logits it computes are not read: rank 0 samples."""
    assert runner.graphs is not None, "graph_step before capture"
    with runner.ws.scope():
        runner.model.before_graph_step(runner.kv, chunks)
        runner.graphs.run(chunks)
        runner.model.after_graph_step(runner.kv, chunks)
    runner.num_steps += 1
    runner.num_graph_steps += 1
    runner.check_device_allocations()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)  # the worker is gone; its collectives would wait for it forever
