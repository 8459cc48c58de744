"""The addressing of a step's prefill chunks (its spans of several tokens), built once per step
on the host from plain lists and copied to the device in one transfer, shared by every layer:
where each chunk's window keys sit in the step's flat window table (the ring rows of the
``window - 1`` tokens before it, then its own rows), which ring rows its last tokens overwrite,
each row's window bounds in that table, and per compression rate the chunks' entry rows in the
pool, each row's entry range and the entries its indexer queries see.

Why: the chunk path (now chunk_attention.py) used to compute all of this per sequence and layer, a dozen
small kernels and host->device copies each. With it, a layer's window reads and writes, window
snapshots, entry reads and attention bounds are one gather or scatter each whatever the number
of chunks. Must never read a device value on the host; every index is made here, from host
data, before the layers run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.deepseek_v4.backend import V4Backend
from engine.models.deepseek_v4.step.rows import to_device


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of the step: rows ``[begin, begin + num_rows)`` of the flat batch, its slot,
    the position of its first token and its block ids (host)."""

    begin: int
    num_rows: int
    slot: int
    start_pos: int
    block_ids: list[int]


@dataclass(frozen=True)
class RateRows:
    """The chunks' compressed entries of one rate after the step."""

    entry_rows: torch.Tensor  # [E] flat pool rows of every chunk's entries, chunk after chunk
    bases: list[int]  # chunk i's first entry in that order
    num_entries: list[int]  # chunk i's entries
    comp_start: torch.Tensor  # [N] int32: row's first entry in the flat order (0: not a chunk row)
    comp_end: torch.Tensor  # [N] int32: one past the last entry the row sees
    kv_end: torch.Tensor  # [N] int64: entries of its own sequence the row sees (its indexer bound)


class ChunkRows:
    """Per-step tensors of the chunks (see the module docstring); device tensors are views of
    one int64 buffer copied once."""

    def __init__(self, chunks: list[ChunkSpan], num_rows: int, window: int, block_size: int,
                 rates: list[int], device: torch.device) -> None:
        self.chunks, self.window = chunks, window
        # (window table rows, flat snapshot rows) of the windows at the block ends the chunks
        # reach: set once per step by the model from the pool's plans (resume_windows.py)
        self.snapshot: tuple[torch.Tensor, torch.Tensor] | None = None
        w = window
        host: dict[str, torch.Tensor] = {}
        ring_src, ring_dst, kv_dst, kv_src, keep_src, keep_dst = [], [], [], [], [], []
        w_start = torch.zeros(num_rows, dtype=torch.long)
        w_end = torch.zeros(num_rows, dtype=torch.long)
        self.offsets: list[int] = []  # chunk i's first row of the window table
        self.num_prev: list[int] = []
        off = 0
        for c in chunks:
            n0, n, prev = c.start_pos, c.num_rows, min(c.start_pos, w - 1)
            self.offsets.append(off)
            self.num_prev.append(prev)
            ring_src.append(c.slot * w + torch.arange(n0 - prev, n0) % w)
            ring_dst.append(torch.arange(off, off + prev))
            kv_dst.append(torch.arange(off + prev, off + prev + n))
            kv_src.append(torch.arange(c.begin, c.begin + n))
            keep = min(n, w)  # the ring keeps the chunk's last `window` tokens
            keep_src.append(torch.arange(c.begin + n - keep, c.begin + n))
            keep_dst.append(c.slot * w + torch.arange(n0 + n - keep, n0 + n) % w)
            end = torch.arange(n) + (off + prev + 1)
            w_end[c.begin : c.begin + n] = end
            w_start[c.begin : c.begin + n] = (end - w).clamp(min=off)
            off += prev + n
        self.table_rows = off
        host["ring_src"], host["ring_dst"] = torch.cat(ring_src), torch.cat(ring_dst)
        host["kv_src"], host["kv_dst"] = torch.cat(kv_src), torch.cat(kv_dst)
        host["keep_src"], host["keep_dst"] = torch.cat(keep_src), torch.cat(keep_dst)
        host["w_start"], host["w_end"] = w_start, w_end
        meta: dict[int, tuple[list[int], list[int]]] = {}
        for r in sorted(set(rates)):
            per = block_size // r
            rows, bases, counts, base = [], [], [], 0
            cs = torch.zeros(num_rows, dtype=torch.long)
            ce = torch.zeros(num_rows, dtype=torch.long)
            ke = torch.zeros(num_rows, dtype=torch.long)
            for c in chunks:
                ne = (c.start_pos + c.num_rows) // r
                e = torch.arange(ne)
                rows.append(torch.tensor(c.block_ids, dtype=torch.long)[e // per] * per + e % per)
                own = (torch.arange(c.num_rows) + c.start_pos + 1) // r
                sl = slice(c.begin, c.begin + c.num_rows)
                cs[sl], ce[sl], ke[sl] = base, base + own, own
                bases.append(base)
                counts.append(ne)
                base += ne
            host[f"rows{r}"], host[f"cs{r}"], host[f"ce{r}"], host[f"ke{r}"] = (
                torch.cat(rows), cs, ce, ke)
            meta[r] = (bases, counts)
        names = list(host)
        flat = to_device(torch.cat([host[k] for k in names]), device)
        dev = dict(zip(names, flat.split([host[k].numel() for k in names]), strict=True))
        self.ring_src, self.ring_dst = dev["ring_src"], dev["ring_dst"]
        self.kv_src, self.kv_dst = dev["kv_src"], dev["kv_dst"]
        self.keep_src, self.keep_dst = dev["keep_src"], dev["keep_dst"]
        i32 = {k: dev[k].to(torch.int32) for k in ("w_start", "w_end")}
        self.w_start, self.w_end = i32["w_start"], i32["w_end"]
        self.rates = {r: RateRows(dev[f"rows{r}"], *meta[r], dev[f"cs{r}"].to(torch.int32),
                                  dev[f"ce{r}"].to(torch.int32), dev[f"ke{r}"])
                      for r in meta}

    def window_table(self, ring: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """[table_rows, D]: every chunk's previous ``window - 1`` keys (from its slot's ring,
        before this step's write) followed by its own. ring: [max_batch, W, D]; kv: [N, D]."""
        flat = ring.view(-1, ring.shape[-1])
        table = kv.new_empty((self.table_rows, kv.shape[-1]))
        table[self.ring_dst] = flat[self.ring_src].to(kv.dtype)
        table[self.kv_dst] = kv[self.kv_src]
        return table

    def write_ring(self, ring: torch.Tensor, kv: torch.Tensor) -> None:
        """Each chunk's last ``window`` keys into its slot's ring (after :meth:`window_table`)."""
        flat = ring.view(-1, ring.shape[-1])
        flat.index_copy_(0, self.keep_dst, kv[self.keep_src].to(flat.dtype))


def attend_chunks(backend: V4Backend, out: torch.Tensor, q: torch.Tensor, table: torch.Tensor,
                  chunks: ChunkRows, comp: torch.Tensor | None, topk: torch.Tensor | None,
                  sinks: torch.Tensor, scale: float, rate: int) -> None:
    """One kernels call (kernels / kernels_ref backends) for every chunk row: its window in the
    flat window table ``table``, its entries in ``comp`` (every chunk's, chunk after chunk):
    CSA the picks ``topk`` ([N, k] int32 into ``comp``, -1 = none), HCA every entry its
    position has closed. out, q: [N, H, D]. Rows of no chunk (a mixed step's decode rows,
    attended afterwards by decode_step.py) have an empty window and no entries: zeros."""
    assert backend.attention in ("kernels", "kernels_ref")
    kw: dict[str, torch.Tensor] = {}
    if comp is not None:
        if comp.shape[0] == 0:  # no entry closed yet anywhere: one zero row nobody sees
            comp = q.new_zeros((1, q.shape[-1]))
        kw["compressed_kv"] = comp
        if topk is not None:
            kw["indices"] = topk
        else:
            kw["compressed_start"] = chunks.rates[rate].comp_start
            kw["compressed_end"] = chunks.rates[rate].comp_end
    if backend.attention == "kernels_ref":
        from kernels.sparse_attention_ref import sparse_attention_ref as fn
    else:
        from kernels.sparse_attention import sparse_attention as fn
    fn(q, table, chunks.w_start, chunks.w_end, scale=scale, out=out, sinks=sinks, **kw)
