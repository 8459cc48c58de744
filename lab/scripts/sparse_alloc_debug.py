"""Which allocator requests a ``sparse_attention`` call makes on CUDA, with their stacks.

    python lab/scripts/sparse_alloc_debug.py      # on a CUDA machine

Diagnostic only (it found that a GPU test's own ``t + window`` was the "kernel allocation").
"""

from __future__ import annotations

import torch

from kernels.sparse_attention import sparse_attention
from lab.bench.sparse_case import realistic_sparse_inputs


def main() -> None:
    q, win, start, end, kw = realistic_sparse_inputs()
    out = torch.full_like(q, float("nan"))

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
