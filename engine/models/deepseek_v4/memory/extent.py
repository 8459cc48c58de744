"""The DeepSeek-V4 KV extent's geometry and sizes, pure arithmetic on the config: the block-size
rule, the bytes a block holds by kind, the per-slot carry, the window snapshots, and the one
formula for a pool's bytes (:func:`deepseek_v4_cache_bytes`), which ``DeepseekV4KVPool``
(kv_pool.py) allocates to and the engine's KV layout (kv_layout.py) reports. Never allocates.
"""

from __future__ import annotations

import hashlib
import math

import torch

from engine.errors import PlanError
from engine.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from engine.models.deepseek_v4.memory.paged_rows import PagedRows
from engine.models.deepseek_v4.memory.resume_windows import num_resume_slabs


def block_multiple(cfg: DeepseekV4Config) -> int:
    """Block sizes must be multiples of this: the lcm of the compression rates in use."""
    rates = [cfg.rate(t) for t in cfg.layer_types if t != SLIDING]
    return math.lcm(*rates) if rates else 1


# vLLM's block size for V4 too: at 1M tokens a sequence's table is 4,096 entries, each block
# closes 64 CSA entries (rate 4) and 2 HCA entries (rate 128), and an LMCache chunk of 256
# tokens is one whole block
DEFAULT_BLOCK_TOKENS = 256


def default_block_size(cfg: DeepseekV4Config) -> int:
    """256 tokens, rounded up to a multiple of the rates' lcm (a toy model's rates may not
    divide 256)."""
    m = block_multiple(cfg)
    return -(-DEFAULT_BLOCK_TOKENS // m) * m


def block_size_problem(cfg: DeepseekV4Config, block_size: int) -> str | None:
    m = block_multiple(cfg)
    if block_size % m == 0:
        return None
    near = max(m, round(block_size / m) * m)
    return (f"block_size={block_size} must be a multiple of {m} (the lcm of this model's "
            f"compression rates) so that no compressor window straddles blocks; {near} would do "
            f"(the default, {default_block_size(cfg)}, when it is not set)")


def check_block_size(cfg: DeepseekV4Config, block_size: int) -> None:
    problem = block_size_problem(cfg, block_size)
    if problem:
        raise PlanError(problem)


def blocks_per_sequence(max_context: int, block_size: int) -> int:
    """Blocks that hold one sequence of ``max_context`` tokens."""
    return -(-max_context // block_size)


def slot_run_blocks(max_batch: int, max_context: int, block_size: int) -> int:
    """Blocks of a pool where each of ``max_batch`` slots owns a run covering ``max_context``
    tokens (``DeepseekV4KVPool.for_slots``), the null block 0 included."""
    return 1 + max_batch * blocks_per_sequence(max_context, block_size)


def v4_fingerprint(cfg: DeepseekV4Config, block_size: int, dtype: torch.dtype, fp8: bool) -> str:
    """Identifies what a block's bytes mean; both sides of a transfer must agree on it."""
    desc = (f"v4-blocks-v3;dtype={str(dtype).removeprefix('torch.')};fp8={int(fp8)};"
            f"bs={block_size};hd={cfg.head_dim};ihd={cfg.index_head_dim};win={cfg.sliding_window};"
            f"csa={cfg.csa_rate};hca={cfg.hca_rate};"
            f"layers={','.join(t[0] for t in cfg.layer_types)};rope={cfg.rope_head_dim}")
    return desc + ";h=" + hashlib.sha256(desc.encode()).hexdigest()[:12]


def block_bytes_by_kind(cfg: DeepseekV4Config, block_size: int, dtype: torch.dtype,
                        fp8: bool) -> dict[str, tuple[int, int, int]]:
    """kind -> (layers, rows per block, bytes per row) of one block, without allocating."""
    check_block_size(cfg, block_size)
    e = torch.empty((), dtype=dtype).element_size()
    row = PagedRows.row_bytes
    n_csa = sum(t == CSA for t in cfg.layer_types)
    out: dict[str, tuple[int, int, int]] = {}
    for lt, name in ((CSA, "csa_entries"), ("heavily_compressed_attention", "hca_entries")):
        n = sum(t == lt for t in cfg.layer_types)
        if n:
            out[name] = (n, block_size // cfg.rate(lt), row(cfg.head_dim, dtype, fp8))
    if n_csa:
        r = cfg.csa_rate
        out["indexer_keys"] = (n_csa, block_size // r, row(cfg.index_head_dim, dtype, fp8))
        out["compressor_carry"] = (n_csa, r, (cfg.head_dim + cfg.index_head_dim) * (e + 4))
    return out


def resume_window_bytes(cfg: DeepseekV4Config, max_batch: int, dtype: torch.dtype,
                        fp8: bool) -> int:
    """The window snapshots: slabs x layers x sliding_window rows (see resume_windows.py)."""
    return (num_resume_slabs(max_batch) * cfg.num_layers * cfg.sliding_window
            * PagedRows.row_bytes(cfg.head_dim, dtype, fp8))


def window_section_bytes(cfg: DeepseekV4Config, dtype: torch.dtype, fp8: bool) -> int:
    """One exported window snapshot (a resume point): every layer's window rows."""
    return cfg.num_layers * cfg.sliding_window * PagedRows.row_bytes(cfg.head_dim, dtype, fp8)


def slot_carry_bytes(cfg: DeepseekV4Config, max_batch: int, dtype: torch.dtype) -> int:
    """The per-slot part: window rings and open-window buffers of ``max_batch`` slots."""
    e = torch.empty((), dtype=dtype).element_size()
    total = 0
    for lt in cfg.layer_types:
        total += max_batch * cfg.sliding_window * cfg.head_dim * e
        if lt == SLIDING:
            continue
        dims = [(cfg.head_dim, lt == CSA)] + ([(cfg.index_head_dim, True)] if lt == CSA else [])
        for dim, overlap in dims:
            total += 2 * max_batch * cfg.rate(lt) * (2 * dim if overlap else dim) * e
    return total


def deepseek_v4_cache_bytes(cfg: DeepseekV4Config, max_batch: int, max_context: int,
                            dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                            block_size: int | None = None) -> dict[str, int]:
    """Bytes of ``DeepseekV4KVPool.for_slots`` by kind (``max_batch`` sequences of
    ``max_context`` tokens each), without allocating it: the blocks of :func:`slot_run_blocks`
    at :func:`block_bytes_by_kind` each, the slots' carry and the resume windows."""
    cfg = DeepseekV4Config.coerce(cfg)
    bs = block_size or block_multiple(cfg)
    num_blocks = slot_run_blocks(max_batch, max_context, bs)
    out = {k: num_blocks * n * rows * rb
           for k, (n, rows, rb) in block_bytes_by_kind(cfg, bs, dtype, fp8).items()}
    out["slot_carry"] = slot_carry_bytes(cfg, max_batch, dtype)
    out["resume_windows"] = resume_window_bytes(cfg, max_batch, dtype, fp8)
    return out
