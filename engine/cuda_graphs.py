"""Decode steps captured as CUDA graphs over the locked workspace and the fixed KV extent.

The workspace makes this natural: every scratch buffer of a step is a view at a fixed offset of
one arena, the KV cache never moves, and the step's inputs live in static buffers allocated here
once. Capture runs after the worst-case warm-up, all graphs share one private pool (largest batch
first), and that pool is a term of the memory plan checked against what capture really took.
Never captures prefill chunks (their shapes vary); those run eagerly.

With several tensor-parallel ranks every rank builds the same graphs (``graph_batch_sizes`` of
the same engine config, captured largest first), so the NCCL all-reduces inside them pair up:
rank 0 announces each capture and each replay, the other ranks do the same at once
(engine/parallel/follower.py). What NCCL keeps on the device for a captured collective lies
outside PyTorch's pool; ``outside_bytes`` measures it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.scheduler import ScheduledChunk
from engine.step_batch import StepBatch
from engine.workspace import Workspace

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    out = [s for s in sizes if s < max_batch] + [max_batch]
    return sorted(set(out))


def capture_order(max_batch: int) -> list[int]:
    """The batch sizes in the order every rank captures them: largest first, so the smaller
    graphs reuse the pool's blocks."""
    return sorted(graph_batch_sizes(max_batch), reverse=True)


class DecodeGraphs:
    def __init__(self, forward: Callable[[StepBatch, Workspace, torch.Tensor], None],
                 ws: Workspace,
                 vocab_size: int, max_batch: int, blocks_per_seq: int, block_size: int,
                 device: torch.device, pad_with_first: bool = False,
                 capture_error_mode: str = "global") -> None:
        """``capture_error_mode`` "thread_local" with several ranks: ProcessGroupNCCL's
        watchdog thread polls the events of earlier collectives while this thread captures,
        which a "global" capture would turn into an error."""
        self._forward = forward
        self.capture_error_mode = capture_error_mode  # (batch, ws, logits_out [bs, vocab]) -> None
        self.ws = ws
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_batch)
        # Pad rows (a graph of 8 replayed for 6 sequences): False -> token 0 at position 0 into
        # the null block (families whose only per-sequence state is in the blocks); True ->
        # copies of row 0, which write the same values to the same places as row 0 (families
        # with per-slot state outside the blocks, such as a sliding-window ring per slot).
        self.pad_with_first = pad_with_first
        m = self.sizes[-1]
        # Step inputs packed into two device buffers, each filled by one copy per step from a
        # pinned host mirror: int64 [ids | positions | slot mapping | cache slots] and int32
        # [context lens | tables].
        self._i64 = torch.zeros(4, m, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(m + m * blocks_per_seq, dtype=torch.int32, device=device)
        self._host_i64 = torch.zeros(4, m, dtype=torch.int64, pin_memory=True)
        self._host_i32 = torch.zeros(m + m * blocks_per_seq, dtype=torch.int32, pin_memory=True)
        self.input_ids, self.positions, self.slot_mapping = self._i64[0], self._i64[1], self._i64[2]
        self.cache_slots = self._i64[3]
        self.context_lens = self._i32[:m]
        self.block_tables = self._i32[m:].view(m, blocks_per_seq)
        self.query_start_loc = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(m, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0
        self.outside_bytes = 0  # device memory capture took outside PyTorch (NCCL's, if any)
        self.captured: list[int] = []  # batch sizes in capture order

    @property
    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self._i64, self._i32, self.query_start_loc, self.rows))

    def _batch(self, bs: int) -> StepBatch:
        return StepBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs], query_start_loc=list(range(bs + 1)),
            context_lens=[1] * bs, block_tables=[[0]] * bs, cache_slots=list(range(bs)),
            logits_indices=self.rows[:bs], block_tables_t=self.block_tables[:bs],
            query_start_loc_t=self.query_start_loc[: bs + 1], context_lens_t=self.context_lens[:bs],
            cache_slots_t=self.cache_slots[:bs])

    def _step(self, bs: int) -> torch.Tensor:
        # The logits buffer sits at the base of the arena for every size, so the sampler that
        # runs after a replay (in a nested scope) never overwrites it.
        logits = self.ws.take((self.sizes[-1], self.vocab_size), torch.float32,
                              caller="cuda_graphs.logits")[:bs]
        with self.ws.scope():
            self._forward(self._batch(bs), self.ws, logits)
        return logits

    def capture(self) -> None:
        dev = self.input_ids.device
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(dev)
        free_before = torch.cuda.mem_get_info(dev)[0]
        reserved_before = torch.cuda.memory_reserved(dev)
        for bs in capture_order(self.sizes[-1]):
            self._reset_inputs()
            # Eager once on the current stream first (compiles any Triton specialisation for this
            # size). Not on a side stream: blocks cached for a side stream are never reused by
            # the serving stream, and every size would leave its own copy behind.
            with self.ws.scope():
                self._step(bs)
            torch.cuda.synchronize(dev)
            # torch.cuda.graph empties the cache as it enters; doing it first keeps the blocks it
            # would free out of the measurement (else the pool's growth can read as negative)
            torch.cuda.empty_cache()
            before_capture = torch.cuda.memory_reserved(dev)
            graph = torch.cuda.CUDAGraph()
            with self.ws.scope(), torch.cuda.graph(graph, pool=pool,
                                                   capture_error_mode=self.capture_error_mode):
                self._logits[bs] = self._step(bs)
            self._graphs[bs] = graph
            self.captured.append(bs)
            torch.cuda.synchronize(dev)
            self.pool_bytes += torch.cuda.memory_reserved(dev) - before_capture
        # free memory that went neither to PyTorch's reserve (graph pool, eager steps) nor back
        taken = free_before - torch.cuda.mem_get_info(dev)[0]
        self.outside_bytes = max(taken - (torch.cuda.memory_reserved(dev) - reserved_before), 0)
        log.info("captured decode graphs for batch sizes %s (pool %.1f MiB)", self.sizes,
                 self.pool_bytes / 2**20)

    def _reset_inputs(self) -> None:
        self._i64.zero_()  # pad rows write into the null block
        self.block_tables.zero_()
        self.context_lens.fill_(1)

    def can_run(self, chunks: list[ScheduledChunk]) -> bool:
        return bool(self._graphs) and 0 < len(chunks) <= self.sizes[-1] and all(
            c.num_tokens == 1 and c.do_sample for c in chunks)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Replay the smallest captured size that fits; -> logits [len(chunks), vocab] fp32, a
        view valid until the enclosing workspace scope ends (the caller holds it open)."""
        n = len(chunks)
        bs = next(s for s in self.sizes if s >= n)
        bsz = self.block_size
        m, width = self.sizes[-1], self.block_tables.shape[1]
        # numpy views of the pinned mirrors: filling them costs no torch dispatch per element.
        # The previous step's copy has completed (its sampled tokens were read on the host).
        h64 = self._host_i64.numpy()
        h32 = self._host_i32.numpy()
        tables = h32[m:].reshape(m, width)
        h64[:, :bs] = 0  # pad rows: token 0 at position 0 into the null block's slot 0
        h32[:bs] = 1  # pad rows' context length
        for i, c in enumerate(chunks):
            p = c.start
            h64[0, i] = c.token_ids[0]
            h64[1, i] = p
            h64[2, i] = c.block_ids[p // bsz] * bsz + p % bsz
            h64[3, i] = c.cache_slot
            h32[i] = c.context_len
            tables[i, : len(c.block_ids)] = c.block_ids
        if self.pad_with_first and bs > n:
            h64[:, n:bs] = h64[:, :1]
            h32[n:bs] = h32[0]
            tables[n:bs] = tables[0]
        # Host -> device copies straight into the static buffers: no device allocation per step.
        self._i64.copy_(self._host_i64, non_blocking=True)  # contiguous; 24 B a row
        self.context_lens[:bs].copy_(self._host_i32[:bs], non_blocking=True)
        self.block_tables[:bs].copy_(self._host_i32[m : m + bs * width].view(bs, width),
                                     non_blocking=True)
        # Same arena offset as at capture: take the logits region, then replay.
        self.ws.take((self.sizes[-1], self.vocab_size), torch.float32, caller="cuda_graphs.logits")
        self._graphs[bs].replay()
        return self._logits[bs][:n]
