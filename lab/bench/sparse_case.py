"""The realistic ``sparse_attention`` call (V4-Flash widths: 64 heads of 512, a 128-token window,
top-512 of 5000 compressed entries, 300 queries) that both the GPU test and the allocation
diagnostic make, so that they look at the very same call. Measurement code: allocates freely."""

from __future__ import annotations

from typing import Any

import torch


def realistic_sparse_inputs(device: str = "cuda", seed: int = 1
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       dict[str, Any]]:
    """(q, window_kv, start, end, keyword arguments) of one sparse_attention call.
    q: [S, H, D] bf16; window_kv: [S + window - 1, D]; start/end: [S] int32."""
    g = torch.Generator(device=device).manual_seed(seed)
    s, h, d, window, topk, nc = 300, 64, 512, 128, 512, 5000
    q = torch.randn(s, h, d, device=device, generator=g).to(torch.bfloat16)
    win = torch.randn(s + window - 1, d, device=device, generator=g).to(torch.bfloat16)
    comp = torch.randn(nc, d, device=device, generator=g).to(torch.bfloat16)
    start = torch.arange(s, device=device, dtype=torch.int32)
    idx = torch.randint(-1, nc, (s, topk), device=device, generator=g, dtype=torch.int32)
    cs = torch.zeros(s, dtype=torch.int32, device=device)
    ce = torch.randint(0, 80, (s,), device=device, generator=g, dtype=torch.int32)
    sinks = torch.randn(h, device=device, generator=g)
    kw = {"scale": d**-0.5, "compressed_kv": comp, "indices": idx, "compressed_start": cs,
          "compressed_end": ce, "sinks": sinks}
    # made here, outside any timed or counted call: the caller must not allocate in it either
    end = start + window
    return q, win, start, end, kw
