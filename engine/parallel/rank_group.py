"""One rank's view of the tensor-parallel group: the model's all-reduce and the control channel.

The model's collectives run on the default process group (gloo on CPU, NCCL on CUDA). Rank 0
tells the others what to do through a second, gloo-only group (plain Python objects and CPU
tensors), so a command never queues behind device work. Owns no model state; never decides
anything: rank 0's engine decides and the other ranks follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DRIVER = 0


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of every other rank: ``op`` with its plain-data arguments."""

    # "forward" | "prepare_warmup" | "lock" | "capture" | "graph_step" | "reset" | "export" |
    # "import" | "import_resume" | "stop"
    op: str
    args: tuple[Any, ...] = ()


class RankGroup:
    """``rank`` of ``size`` processes on one host; ``init_file`` is the rendezvous (a path no
    other group uses). ``timeout_s`` bounds how long a collective waits for a silent peer."""

    def __init__(self, rank: int, size: int, device: torch.device, init_file: str,
                 timeout_s: float = 600.0) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
        self.control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        if backend == "nccl":
            # NCCL sets up its communicator (and cudaMallocs its buffers) on the first
            # collective: do it now, so start-up measures those bytes as non-torch memory.
            dist.all_reduce(torch.zeros(1, device=device))
            torch.cuda.synchronize(device)

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    @property
    def can_capture(self) -> bool:
        """Whether a CUDA graph can hold this group's all-reduce (NCCL's can; gloo's runs on the
        host and stays eager)."""
        return dist.get_backend() == "nccl"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (a row-parallel projection's partial sums)."""
        dist.all_reduce(t)
        return t

    # -- control channel: rank 0 sends, the others receive ------------------------------------
    def send(self, cmd: Command) -> None:
        assert self.is_driver
        dist.broadcast_object_list([cmd], src=DRIVER, group=self.control)

    def receive(self) -> Command:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=DRIVER, group=self.control)
        return box[0]

    def broadcast_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` (CPU) into every rank's ``t`` of the same shape and dtype."""
        dist.broadcast(t, src=DRIVER, group=self.control)
        return t

    def gather_cpu(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (CPU, same shape everywhere) on rank 0, in rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)] if self.is_driver else None
        dist.gather(t, out, dst=DRIVER, group=self.control)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
