"""PyTorch reference of DeepSeek-V4 sparse attention: the specification of ``sparse_attention``.

Plain, readable, fp32 arithmetic; it materialises every row's gathered entries, so it is for
tests, the CPU engine and small shapes only. It must never be "optimised" away from the
definition in ``kernels.sparse_attention``'s docstring: the Triton kernel is checked against it.
"""

from __future__ import annotations

import torch


def _window_rows(
    window_kv: torch.Tensor,
    start: int,
    end: int,
    seq: int,
    window_block_tables: torch.Tensor | None,
) -> torch.Tensor:
    """The window's entries of one row as [n, D] (flat range, or token positions of a paged seq)."""
    if end <= start:
        return window_kv.new_zeros((0, window_kv.shape[-1]))
    if window_block_tables is None:
        return window_kv[start:end]
    pages = window_kv.reshape(window_kv.shape[0], window_kv.shape[1], window_kv.shape[-1])
    block_size = pages.shape[1]
    pos = torch.arange(start, end, device=window_kv.device)
    blocks = window_block_tables[seq].long()[pos // block_size]
    return pages[blocks, pos % block_size]


def sparse_attention_ref(
    q: torch.Tensor,
    window_kv: torch.Tensor,
    window_start: torch.Tensor,
    window_end: torch.Tensor,
    *,
    scale: float,
    out: torch.Tensor | None = None,
    compressed_kv: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    compressed_start: torch.Tensor | None = None,
    compressed_end: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window_block_tables: torch.Tensor | None = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.sparse_attention`` (see there); returns ``out`` ([S, H, D])."""
    num_rows, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    ws, we = window_start.tolist(), window_end.tolist()
    seqs = row_seq.tolist() if row_seq is not None else [0] * num_rows
    for t in range(num_rows):
        parts = [_window_rows(window_kv, ws[t], we[t], seqs[t], window_block_tables)]
        if indices is not None:
            assert compressed_kv is not None
            idx = indices[t].long()
            parts.append(compressed_kv[idx[idx >= 0]])
        if compressed_start is not None:
            assert compressed_kv is not None and compressed_end is not None
            parts.append(compressed_kv[int(compressed_start[t]) : int(compressed_end[t])])
        kv = torch.cat([p.reshape(-1, head_dim).float() for p in parts])  # [E, D]; K = V
        logits = (q[t].float() @ kv.T) * scale  # [H, E]
        if sinks is not None:
            logits = torch.cat([logits, sinks.float().reshape(num_heads, 1)], dim=1)
        if logits.shape[1] == 0:
            out[t] = 0
            continue
        probs = torch.softmax(logits, dim=1)[:, : kv.shape[0]]
        out[t] = (probs @ kv).to(out.dtype)
    return out
