"""Which allocator requests a ``sparse_attention`` call makes on CUDA, with their stacks.

    python scripts/sparse_alloc_debug.py      # on a CUDA machine

Diagnostic only (it found that a GPU test's own ``t + window`` was the "kernel allocation").
"""

from __future__ import annotations

import torch

from kernels.sparse_attention import sparse_attention


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    s, h, d, window, topk, nc = 300, 64, 512, 128, 512, 5000
    q = torch.randn(s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    win = torch.randn(s + window - 1, d, device="cuda", generator=g).to(torch.bfloat16)
    comp = torch.randn(nc, d, device="cuda", generator=g).to(torch.bfloat16)
    start = torch.arange(s, device="cuda", dtype=torch.int32)
    end = start + window
    idx = torch.randint(-1, nc, (s, topk), device="cuda", generator=g, dtype=torch.int32)
    cs = torch.zeros(s, dtype=torch.int32, device="cuda")
    ce = torch.randint(0, 80, (s,), device="cuda", generator=g, dtype=torch.int32)
    sinks = torch.randn(h, device="cuda", generator=g)
    out = torch.full_like(q, float("nan"))
    kw = {"scale": d**-0.5, "compressed_kv": comp, "indices": idx, "compressed_start": cs,
          "compressed_end": ce, "sinks": sinks}

    def call() -> None:
        sparse_attention(q, win, start, end, out=out, **kw)

    call()  # compiles
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.memory._record_memory_history(max_entries=1000)
    call()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print("allocator requests in the second call:",
          torch.cuda.memory_stats()["allocation.all.allocated"] - before)
    for e in snap.get("device_traces", [[]])[0]:
        if e["action"] in ("alloc", "free_requested"):
            frames = [(f["filename"].split("/")[-1], f["line"], f["name"])
                      for f in e.get("frames", [])[:12]]
            print(e["action"], e["size"], frames)


if __name__ == "__main__":
    main()
