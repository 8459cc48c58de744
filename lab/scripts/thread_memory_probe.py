"""GPU probe: device memory taken outside PyTorch's allocator when a new host thread runs its
first GEMMs, and whether a thread that starts after another has ended reuses its handles
(worker/engine_loop.build_on_a_passing_thread relies on it).

`python3 lab/scripts/thread_memory_probe.py` on a CUDA machine prints one THREADPROBE line of MiB:
the first GEMMs of the main thread, of a new thread while the main one lives, of a thread that
starts after that one ended, and of a thread started while another GEMM thread is still alive.
"""

from __future__ import annotations

import json
import threading

import torch

DEV = torch.device("cuda:0")


def free_bytes() -> int:
    torch.cuda.synchronize(DEV)
    return torch.cuda.mem_get_info(DEV)[0]


def gemms(dtype: torch.dtype = torch.bfloat16) -> None:
    """A prefill-sized and a decode-sized GEMM, and a linear with bias (cuBLASLt's epilogue)."""
    w = torch.randn(4096, 4096, device=DEV, dtype=dtype)
    for m in (4096, 3):
        x = torch.randn(m, 4096, device=DEV, dtype=dtype)
        (x @ w).sum().item()
        torch.nn.functional.linear(x, w, torch.zeros(4096, device=DEV, dtype=dtype)).sum().item()


def outside_mib(fn) -> tuple[float, float]:
    """(MiB taken outside PyTorch's reserve, MiB PyTorch's reserve grew) while ``fn`` ran."""
    f0, r0 = free_bytes(), torch.cuda.memory_reserved(DEV)
    fn()
    f1, r1 = free_bytes(), torch.cuda.memory_reserved(DEV)
    return ((f0 - f1) - (r1 - r0)) / 2**20, (r1 - r0) / 2**20


def on_thread(out: dict[str, float], key: str) -> None:
    def run() -> None:
        out[key], out[key + "_reserved"] = outside_mib(gemms)

    t = threading.Thread(target=run)
    t.start()
    t.join()


def main() -> None:
    out: dict[str, float] = {}
    torch.zeros(1, device=DEV)
    out["main_thread"], out["main_thread_reserved"] = outside_mib(gemms)
    on_thread(out, "new_thread")
    on_thread(out, "thread_after_one_ended")
    ready, release = threading.Event(), threading.Event()

    def hold() -> None:
        gemms()
        ready.set()
        release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    ready.wait()
    on_thread(out, "thread_beside_a_live_one")
    release.set()
    holder.join()
    print("THREADPROBE", json.dumps({k: round(v, 1) for k, v in out.items()}))


if __name__ == "__main__":
    main()
