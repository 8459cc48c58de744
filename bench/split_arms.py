"""The two arms of the split benchmark as OS processes on one GPU, and what they hold there.

Arm "split": a prefill worker that loads the weights and exports them (one-box mode), a decode
worker that maps them, KV handed over through LMCache into Redis, and the router. Arm
"colocated": one decode worker (no KV store) that prefills and decodes everything, and the router.
The prefill worker starts first and the decode worker once the prefill worker holds the loader
claim, so the weights are always owned by the prefill process (whose plan budgets them).

``MemorySampler`` reads nvidia-smi (total used, and per process where the driver reports it)
at a fixed interval; ``worker_log_figures`` reads what the workers logged (plans, allocations
after warm-up, handoff times).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.worker_env import WORKER_ENV
from launch.health import grpc_serving, router_ready
from launch.launcher import ProcessGroup, free_port, spawn, wait_until


@dataclass(frozen=True)
class WorkerShape:
    """Engine flags of one worker process."""

    max_context: int
    chunk_tokens: int
    max_batch: int
    num_blocks: int
    memory_utilization: float

    def flags(self) -> list[str]:
        return ["--max-context", str(self.max_context), "--chunk-tokens", str(self.chunk_tokens),
                "--max-batch", str(self.max_batch), "--num-blocks", str(self.num_blocks),
                "--memory-utilization", str(self.memory_utilization)]


@dataclass
class Arm:
    name: str
    group: ProcessGroup
    url: str
    pids: dict[int, str]  # pid -> role
    logs: dict[str, Path]
    startup_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        self.group.stop_all(grace_s=15.0)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def _worker(group: ProcessGroup, role: str, name: str, model: str, flags: list[str],
            env: dict[str, str], log_dir: Path) -> tuple[Any, str]:
    port = free_port()
    proc = group.add(spawn(name, _cli(role, "--model", model, "--port", str(port), *flags),
                           env={**WORKER_ENV, **env}, log_dir=log_dir))
    return proc, f"127.0.0.1:{port}"


def start_split(model: str, redis_url: str, prefill: WorkerShape, decode: WorkerShape,
                common_flags: list[str], handle: Path, log_dir: Path, *, share: bool = True,
                timeout_s: float = 600.0) -> Arm:
    """``share``: one copy of the weights (CUDA); False: each worker loads its own."""
    t0 = time.monotonic()
    group = ProcessGroup()
    try:
        shared = ["--share-weights", str(handle)] if share else []
        env = {"BULKHEAD_KV_STORE_URL": redis_url}
        handle.unlink(missing_ok=True)
        handle.with_name(handle.name + ".lock").unlink(missing_ok=True)
        pre, pre_addr = _worker(group, "prefill", "split_prefill", model,
                                [*common_flags, *prefill.flags(), *shared], env, log_dir)
        if share:
            lock = handle.with_name(handle.name + ".lock")
            wait_until(pre, lambda: lock.exists(), timeout_s, "the weight loader claim")
        dec, dec_addr = _worker(group, "decode", "split_decode", model,
                                [*common_flags, *decode.flags(), *shared], env, log_dir)
        for proc, addr in ((pre, pre_addr), (dec, dec_addr)):
            wait_until(proc, lambda a=addr: grpc_serving(a), timeout_s, f"serving on {addr}")
        url = _router(group, model, ["--prefill", pre_addr, "--decode", dec_addr], log_dir,
                      "split_router", 2)
    except BaseException:
        group.stop_all()
        raise
    return Arm("split", group, url, {pre.pid: "prefill", dec.pid: "decode"},
               {"prefill": pre.log_path, "decode": dec.log_path}, time.monotonic() - t0)


def start_colocated(model: str, shape: WorkerShape, common_flags: list[str], log_dir: Path,
                    timeout_s: float = 600.0) -> Arm:
    t0 = time.monotonic()
    group = ProcessGroup()
    try:
        dec, addr = _worker(group, "decode", "colocated", model,
                            [*common_flags, *shape.flags()], {}, log_dir)
        wait_until(dec, lambda: grpc_serving(addr), timeout_s, f"serving on {addr}")
        url = _router(group, model, ["--decode", addr], log_dir, "colocated_router", 1)
    except BaseException:
        group.stop_all()
        raise
    return Arm("colocated", group, url, {dec.pid: "colocated"}, {"colocated": dec.log_path},
               time.monotonic() - t0)


def start_with_up(name: str, opts: Any) -> Arm:
    """An arm started as a user starts Bulkhead: ``launch.up.start`` with ``opts`` (an
    ``UpOptions``: share_weights for one card and two roles, colocated for one worker)."""
    from launch.up import start

    deployment = start(opts, log=lambda line: print(f"[{name}] {line}", flush=True))
    pids, logs = {}, {}
    for proc in deployment.group.processes:
        if proc.name in ("prefill", "decode"):
            role = "colocated" if opts.colocated else proc.name
            pids[proc.pid] = role
            if proc.log_path is not None:
                logs[role] = proc.log_path
    return Arm(name, deployment.group, deployment.url, pids, logs, deployment.startup_s)


def _router(group: ProcessGroup, model: str, workers: list[str], log_dir: Path, name: str,
            num_workers: int) -> str:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = group.add(spawn(name, _cli("router", "--model", model, "--port", str(port),
                                        *workers), log_dir=log_dir))
    wait_until(router, lambda: router_ready(url, num_workers), 120.0, f"healthy at {url}")
    return url


class MemorySampler:
    """nvidia-smi every ``interval_s``: "total" (memory.used) and, where the driver lists
    compute processes, each known pid by its role. Samples are (seconds since ``t0``, {label:
    MiB})."""

    def __init__(self, pids: dict[int, str], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, t0: float) -> MemorySampler:
        self.t0 = t0
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, dict[str, float]]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, read_device_memory(self.pids)))
            self._stop.wait(self.interval_s)


def label_by_plan(samples: list[tuple[float, dict[str, float]]],
                  plans: dict[str, float | None]) -> tuple[list[tuple[float, dict[str, float]]], str]:
    """Where nvidia-smi lists our processes under other pids (a container sees the host's pids),
    give each unknown ``pid N`` the role whose plan (MiB) is nearest its mean use, when there
    are as many unknown pids as roles. Returns the samples and how they are labelled."""
    roles = {r: p for r, p in plans.items() if p}
    seen = {k for _, m in samples for k in m if k != "total"}
    if not seen or seen & set(plans) or len(seen) != len(roles):
        return samples, "by pid" if seen & set(plans) else "unlabelled"
    mean = {k: sum(m[k] for _, m in samples if k in m) / sum(1 for _, m in samples if k in m)
            for k in seen}
    names: dict[str, str] = {}
    for k in sorted(seen, key=lambda k: -mean[k]):  # largest first takes the largest plan
        role = min((r for r in roles if r not in names.values()),
                   key=lambda r: abs(roles[r] - mean[k]))
        names[k] = role
    return ([(t, {names.get(k, k): v for k, v in m.items()}) for t, m in samples],
            "nearest plan (nvidia-smi lists host pids)")


def read_device_memory(pids: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True,
                               timeout=10).stdout.split()
        if total:
            out["total"] = float(total[0])
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return out
    for line in apps.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[pids.get(int(parts[0]), f"pid {parts[0]}")] = float(parts[1])
            except ValueError:
                continue
    return out


_PLAN = re.compile(r"memory plan: ([\d,]+) MiB.*?KV extent (\d+) blocks")
_ARENA = re.compile(r"(packed the weights in one|mapped) ([\d,]+) MiB")
_ALLOC = re.compile(r"made (\d+) device allocation\(s\) after warm-up")
_PUT = re.compile(r"prefill \S+: (\d+) prompt tokens \((\d+) loaded\), computed in ([\d.]+) s, "
                  r"(?:waited ([\d.]+) s for the store's pool, )?"
                  r"KV put ([\d.]+) s, (\d+) tokens visible after ([\d.]+) s")
_FETCH = re.compile(r"KV fetch: (\d+) of (\d+) prompt tokens (?:\([\d.]+ MiB\) )?in ([\d.]+) s")


def worker_log_figures(path: Path) -> dict[str, Any]:
    """What one worker logged: its plan's total (MiB), the weight arena it packed or mapped,
    device allocations after warm-up, and its handoff lines."""
    text = path.read_text(errors="replace") if path.exists() else ""
    plan = _PLAN.findall(text)
    arena = _ARENA.findall(text)
    return {
        "plan_mib": float(plan[-1][0].replace(",", "")) if plan else None,
        "kv_blocks": int(plan[-1][1]) if plan else None,
        "weights": ({"how": "owned" if arena[-1][0].startswith("packed") else "mapped",
                     "mib": float(arena[-1][1].replace(",", ""))} if arena else None),
        "device_allocs_after_warmup": sum(int(n) for n in _ALLOC.findall(text)),
        "prefills": [{"prompt_tokens": int(a), "loaded": int(b), "compute_s": float(c),
                      "pool_wait_s": float(w or 0), "put_s": float(d), "visible_tokens": int(e),
                      "visible_s": float(f)}
                     for a, b, c, w, d, e, f in _PUT.findall(text)],
        "fetches": [{"tokens": int(a), "prompt_tokens": int(b), "seconds": float(c)}
                    for a, b, c in _FETCH.findall(text)],
        "errors": [ln for ln in text.splitlines()
                   if "Traceback" in ln or " ERROR " in ln or "OutOfMemory" in ln][:5],
    }
