"""The lightning indexer's decode scores as one kernel per tile: each row's single query against
a tile of its own sequence's compressed entries, read from the paged pool through its block
table (DeepSeek-V4's CSA layers). Unfused that is a gather of the keys, an fp32 copy, a batched
matmul, ReLU, weighting, a sum and a mask, each its own kernel. The running top-k over tiles
stays with the caller. ``kernels.indexer_decode_ref`` is the specification; writes into
``out``, no scratch.
"""

from __future__ import annotations

import torch

from kernels._checks import check_tensor
from kernels._triton_support import require_triton
from kernels.errors import KernelArgumentError

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def indexer_decode_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                          tables: torch.Tensor, kv_end: torch.Tensor, first: int, num: int,
                          per_block: int, out: torch.Tensor) -> torch.Tensor:
    """See ``indexer_decode_scores_ref``; out [B, num] fp32 -> out."""
    name = "indexer_decode_scores"
    dev = q.device
    check_tensor(name, "q", q, shape=(None, None, None), dtypes=_DTYPES, device=dev)
    b, h, d = q.shape
    check_tensor(name, "weights", weights, shape=(b, h), dtypes=(torch.float32,), device=dev)
    check_tensor(name, "keys", keys, shape=(None, d), dtypes=(q.dtype,), device=dev)
    check_tensor(name, "tables", tables, shape=(b, None), dtypes=(torch.int64,), device=dev)
    check_tensor(name, "kv_end", kv_end, shape=(b,), dtypes=(torch.int64,), device=dev)
    check_tensor(name, "out", out, shape=(b, num), dtypes=(torch.float32,), device=dev)
    if per_block <= 0:
        raise KernelArgumentError(name, "per_block", f"must be > 0, got {per_block}")
    if first < 0 or num < 0 or first + num > tables.shape[1] * per_block:
        raise KernelArgumentError(name, "num", f"entries [{first}, {first + num}) outside the "
                                  f"tables' {tables.shape[1] * per_block}")
    if kv_end.stride(0) != 1:
        raise KernelArgumentError(name, "kv_end", f"must be contiguous, got strides {kv_end.stride()}")
    require_triton(name, dev)
    from kernels._indexer_decode_triton import launch_indexer_decode

    if b and num:
        launch_indexer_decode(q, weights, keys, tables, kv_end, first, num, per_block, out)
    return out
