import torch, traceback
from kernels.sparse_attention import sparse_attention
g = torch.Generator(device="cuda").manual_seed(1)
s, h, d, window, topk, nc = 300, 64, 512, 128, 512, 5000
q = torch.randn(s, h, d, device="cuda", generator=g).to(torch.bfloat16)
win = torch.randn(s + window - 1, d, device="cuda", generator=g).to(torch.bfloat16)
comp = torch.randn(nc, d, device="cuda", generator=g).to(torch.bfloat16)
t = torch.arange(s, device="cuda", dtype=torch.int32)
idx = torch.randint(-1, nc, (s, topk), device="cuda", generator=g, dtype=torch.int32)
cs = torch.zeros(s, dtype=torch.int32, device="cuda")
ce = torch.randint(0, 80, (s,), device="cuda", generator=g, dtype=torch.int32)
sinks = torch.randn(h, device="cuda", generator=g)
out = torch.full_like(q, float("nan"))
kw = {"scale": d**-0.5, "compressed_kv": comp, "indices": idx, "compressed_start": cs, "compressed_end": ce, "sinks": sinks}
f = lambda: sparse_attention(q, win, t, t + window, out=out, **kw)
f(); torch.cuda.synchronize()
import triton, triton.runtime._allocation as A
print("triton allocator:", getattr(A, "_allocator", None))
before = torch.cuda.memory_stats()["allocation.all.allocated"]
torch.cuda.memory._record_memory_history(max_entries=1000)
f(); torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
print("allocations in 2nd call:", torch.cuda.memory_stats()["allocation.all.allocated"] - before)
for e in snap.get("device_traces", [[]])[0]:
    if e["action"] in ("alloc", "free_requested"):
        print(e["action"], e["size"], [ (fr["filename"].split("/")[-1], fr["line"], fr["name"]) for fr in e.get("frames", [])[:12]])
