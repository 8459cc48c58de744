"""What ``bulkhead up`` is asked to start (``UpOptions``) and the command line and environment
each child gets from it. Plain data to flags: nothing here starts a process or reads a
worker's settings (the workers check the values they are given)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from launch.launcher import LaunchError


@dataclass(frozen=True)
class UpOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = ""
    prefill_port: int = 0  # 0 = a free port
    decode_port: int = 0
    config: str = ""
    log_dir: str = ""
    startup_timeout_s: float = 600.0
    # speculative decoding on the decode worker ("" / 0 = the workers' setting): the prefill
    # worker samples one token and verifies nothing
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    # one copy of the weights on one GPU for both workers (CUDA IPC, engine/weight_share.py),
    # the budget the weights leave split prefill_memory_share : 1 - prefill_memory_share
    share_weights: bool = False
    prefill_memory_share: float = 0.5
    colocated: bool = False  # a decode worker alone computes every prompt (no prefill worker)
    # flags both workers get: the workers' own (worker_limit_flags turns up's limits into them)
    extra_worker_args: tuple[str, ...] = ()
    extra_router_args: tuple[str, ...] = ()


def thread_env(opts: UpOptions) -> dict[str, str]:
    """Two workers on one host each take every core by default (torch's thread pool), and on a
    CPU-only machine they then fight over them through the whole warm-up: a 2-core machine took
    ~3x longer to be healthy. Each worker gets half the cores unless the user chose a number
    (BULKHEAD_NUM_THREADS, or a --config file, which may set num_threads)."""
    if opts.config or os.environ.get("BULKHEAD_NUM_THREADS"):
        return {}
    return {"BULKHEAD_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 2))}


# up's flags that size both workers: passed on as the workers' own flags, which check them
LIMIT_FLAGS = ("max_context", "max_batch", "chunk_tokens", "tensor_parallel_size",
               "kv_cache_dtype", "load_format")


def worker_limit_flags(args: object) -> tuple[str, ...]:
    """The worker flags of ``args`` (up's parsed flags, or a harness's of the same names) that
    are given: "" / 0 / missing = the workers' own setting (flag > BULKHEAD_* env > --config >
    WorkerSettings default). ``up`` holds none of these values: the workers own them."""
    flags: list[str] = []
    for name in LIMIT_FLAGS:
        value = getattr(args, name, "")
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, int) and value < 0:
            raise LaunchError(f"{flag}: {value} must be >= 1 (0 = default)")
        if value:
            flags += [flag, str(value)]
    return tuple(flags)


def spec_flags(opts: UpOptions, role: str) -> tuple[str, ...]:
    """The decode worker's speculative decoding flags (vLLM's spellings)."""
    if opts.num_speculative_tokens < 0:
        raise LaunchError(f"--num-speculative-tokens: {opts.num_speculative_tokens} must be "
                          ">= 1 (0 = the workers' setting, 3)")
    if role != "decode":
        return ()
    flags: list[str] = []
    if opts.speculative_method:
        flags += ["--speculative-method", opts.speculative_method]
    if opts.num_speculative_tokens:
        flags += ["--num-speculative-tokens", str(opts.num_speculative_tokens)]
    return tuple(flags)


def role_flags(opts: UpOptions, role: str, log_dir: Path) -> tuple[str, ...]:
    """One-box mode: both workers map one copy of the weights and split what it leaves."""
    if not opts.share_weights:
        return ()
    if not 0 < opts.prefill_memory_share < 1:
        raise LaunchError(f"--prefill-memory-share: {opts.prefill_memory_share} is not in (0, 1)")
    share = opts.prefill_memory_share if role == "prefill" else 1 - opts.prefill_memory_share
    return ("--share-weights", str(log_dir / "weights.handle"), "--memory-share", f"{share:g}")


def tool_args(chat_template: str, tool_call_parser: str) -> tuple[str, ...]:
    """The router flags of ``up``'s --chat-template and --tool-call-parser."""
    out: tuple[str, ...] = ()
    if chat_template:
        out += ("--chat-template", str(Path(chat_template).resolve()))
    if tool_call_parser:
        out += ("--tool-call-parser", tool_call_parser)
    return out
