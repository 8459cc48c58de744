"""``bulkhead bench split OUT_DIR``: what splitting prefill from decode buys on one GPU.

In one run, against the same random-weight model (bench/synthetic_model.py): arm "split" (a
prefill and a decode process sharing one copy of the weights, KV through LMCache into Redis) and
arm "colocated" (one worker doing both), each under the same workload (bench/split_load.py:
streaming chats while long prompts arrive). Writes ``split.json`` (ITL p50/p99/max overall and
while a long prompt is prefilled, TTFT of the long prompts, throughput, each process's plan and
device allocations after warm-up, device memory over time, the handoff of the long prompts as
the workers logged it) and ``split.png``; with ``--handoff-tokens N`` also the handoff of an
N-token prompt on its own next to a host memcpy (bench/split_handoff.py).

    bulkhead bench split OUT --shape llama3-8b --long-tokens 8192,32768 --duration-s 30
    bulkhead bench split OUT --shape tiny --device cpu --long-tokens 300,600 --chats 2 ...

Never imported by the runtime. The workers run with allocations after warm-up counted and
logged (not failing the step), so a figure still comes back if one happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.split_arms import (
    Arm,
    MemorySampler,
    WorkerShape,
    label_by_plan,
    read_device_memory,
    start_colocated,
    start_split,
    start_with_up,
    worker_log_figures,
)
from bench.split_load import Workload, run_workload
from bench.split_report import plot, resident_check, summarize

TEMPLATE_TOKENS = 64  # the chat template's tokens around a prompt, with margin


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def shapes(args: argparse.Namespace) -> dict[str, WorkerShape]:
    longest = max(args.long_tokens) + TEMPLATE_TOKENS
    max_context = longest + max(args.output_tokens, args.long_output_tokens)
    per_long = _blocks(max_context, args.block_size)
    chats = args.chats * _blocks(args.chat_prompt_chars + TEMPLATE_TOKENS + args.output_tokens,
                                 args.block_size)
    batch = args.chats + 4
    # Two long prompts may be in flight at once (one every few seconds, each seconds long).
    decode_blocks = chats + 2 * per_long + 1
    return {
        "prefill": WorkerShape(max_context, args.chunk_tokens, 4, 2 * per_long + 1,
                               args.prefill_util),
        "decode": WorkerShape(max_context, args.chunk_tokens, batch, decode_blocks,
                              args.decode_util),
        "colocated": WorkerShape(max_context, args.chunk_tokens, batch, decode_blocks,
                                 args.colocated_util),
    }


def run_arm(arm: Arm, model_name: str, workload: Workload) -> dict[str, Any]:
    idle = read_device_memory(arm.pids)  # after start-up, before any request
    t0 = time.perf_counter()
    sampler = MemorySampler(arm.pids).start(t0)
    try:
        records = asyncio.run(run_workload(arm.url, model_name, workload))
    finally:
        memory = sampler.stop()
    figures = {role: worker_log_figures(path) for role, path in arm.logs.items()}
    plans = {role: w["plan_mib"] for role, w in figures.items()}
    memory, labels = label_by_plan(memory, plans)
    idle = label_by_plan([(0.0, idle)], plans)[0][0][1]
    return {"startup_s": round(arm.startup_s, 1), "idle_device_mib": idle,
            "summary": summarize(records, workload.duration_s), "workers": figures,
            "memory": memory, "memory_labels": labels, "records": records}


def _kv_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token in bf16 (what LMCache's staging pool must hold)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2


def _served_model(url: str) -> str:
    from launch.health import served_model_name

    return served_model_name(url)


def _redis_figures(url: str) -> dict[str, Any]:
    """The store's memory and evictions so far (counted from the run's start): a handoff
    evicted before its decode worker read it is recomputed there, which the ITL shows."""
    import redis

    try:
        info = redis.Redis.from_url(url, socket_timeout=10).info()
    except Exception as exc:  # noqa: BLE001 - a figure, not the run
        return {"error": repr(exc)}
    return {k: info.get(k) for k in ("evicted_keys", "used_memory_peak", "maxmemory", "keyspace_hits",
                                     "keyspace_misses")}


def _print_arm(name: str, arm: dict[str, Any]) -> None:
    """The arm's figures as lines a person reads (split.json has everything)."""
    s = arm["summary"]
    itl, during = s["itl_ms"], s["itl_ms_while_long_prefill"]
    flight = s["itl_ms_while_long_in_flight"]
    print(f"[{name}] started in {arm['startup_s']} s; chats {s['chat_output_tokens_per_s']} "
          f"tok/s, {s['chats_finished']} finished, {s['num_errors']} errors", flush=True)
    print(f"[{name}] ITL ms p50/p99/max {itl['p50']}/{itl['p99']}/{itl['max']} (n={itl['count']});"
          f" while a long prompt is prefilled {during['p50']}/{during['p99']}/{during['max']};"
          f" in flight {flight['p50']}/{flight['p99']}/{flight['max']}", flush=True)
    for x in s["long_ttft_s"]:
        print(f"[{name}] long prompt {x['prompt_tokens']} tokens at {x['arrived_s']} s: TTFT "
              f"{x['ttft_s']} s, 2nd token {x['second_token_s']} s, last {x['last_token_s']} s "
              f"{x['error']}", flush=True)
    for role, w in arm["workers"].items():
        print(f"[{name}] {role}: plan {w['plan_mib']} MiB, weights {w['weights']}, device "
              f"allocations after warm-up {w['device_allocs_after_warmup']}", flush=True)
    print(f"[{name}] redis: {arm.get('redis')}", flush=True)
    if "resident_check" in arm:
        print(f"[{name}] resident: {arm['resident_check']}", flush=True)


def _up_options(args: argparse.Namespace, model: str, arm: str, redis_url: str,
                log_dir: Path, common: list[str]) -> Any:
    """The `bulkhead up` of one arm: the run's Redis, the same settings for both arms, one card
    shared by two roles (split) or one worker doing both (colocated)."""
    from launch.launcher import free_port
    from launch.up_options import UpOptions, worker_limit_flags

    share = args.share_weights if args.share_weights is not None else args.device != "cpu"
    return UpOptions(model=model, port=free_port(), redis_url=redis_url, log_dir=str(log_dir),
                     config=args.config, share_weights=arm == "split" and share,
                     prefill_memory_share=args.prefill_memory_share,
                     colocated=arm == "colocated",
                     extra_worker_args=(*worker_limit_flags(args), *common))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bulkhead bench split", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="", help="Checkpoint folder ('' = write --shape there).")
    p.add_argument("--shape", default="llama3-8b", help="bench.synthetic_model shape.")
    p.add_argument("--model-dir", default="", help="Where to write it ('' = /dev/shm or tmp).")
    p.add_argument("--shard-gb", type=float, default=4.0, help="Shard size of a written model.")
    p.add_argument("--device", default="cuda")
    p.add_argument("--arms", default="split,colocated",
                   help="Comma-separated, of split and colocated; '' = none (--handoff-tokens "
                        "alone).")
    p.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="Arm split shares one copy of the weights (default: on CUDA).")
    p.add_argument("--long-tokens", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(8192, 32768))
    # the workload and the workers' sizes: plain numbers, typed by their defaults
    for flag, default in (("--long-every-s", 6.0), ("--first-long-s", 4.0),
                          ("--long-output-tokens", 4), ("--chats", 16),
                          ("--chat-prompt-chars", 64), ("--output-tokens", 256),
                          ("--duration-s", 30.0), ("--chunk-tokens", 2048),
                          ("--block-size", 0),
                          ("--prefill-util", 0.4), ("--decode-util", 0.3),
                          ("--colocated-util", 0.5)):
        p.add_argument(flag, type=type(default), default=default)
    up = p.add_argument_group("served arms (--up): each arm is `bulkhead up` with these "
                              "settings, as an operator starts it")
    up.add_argument("--up", action="store_true",
                    help="Start the arms through `bulkhead up` (split: --share-weights on a "
                    "GPU; colocated: --colocated) instead of sizing each worker here.")
    up.add_argument("--config", default="", help="YAML settings (worker:, prefill:, decode:, "
                    "router: sections) for every process, as `bulkhead up --config`.")
    up.add_argument("--load-format", default="", help="auto | dummy ('' = the workers').")
    up.add_argument("--kv-cache-dtype", default="", help="auto | fp8 ('' = the workers').")
    up.add_argument("--max-context", default="", help="tokens or auto ('' = the workers').")
    up.add_argument("--max-batch", type=int, default=0, help="0 = the workers'.")
    up.add_argument("--prefill-memory-share", type=float, default=0.5)
    p.add_argument("--agent-tools", action="store_true",
                   help="Chats are agent turns: tools with tool_choice auto, an earlier tool "
                   "call and its result.")
    p.add_argument("--handoff-tokens", type=int, default=0,
                   help="Also time the handoff of a prompt this long on its own (0 = no).")
    p.add_argument("--redis-maxmemory-mb", type=int, default=40000)
    p.add_argument("--redis-io-threads", type=int, default=1,
                   help="io-threads of the run's redis-server (the workers' fetch connections: "
                        "--extra-worker-flag=--kv-fetch-connections=N)")
    p.add_argument("--lmcache-chunk-size", type=int, default=0,
                   help="tokens per LMCache chunk, both workers and the handoff measurement "
                        "(0: the workers' own choice from the KV layout)")
    p.add_argument("--extra-worker-flag", action="append", default=[],
                   help="Passed to every worker (repeat), e.g. --extra-worker-flag=--num-threads=1")
    return p


def main(argv: Sequence[str] | None = None) -> int:  # noqa: C901 - the run, top to bottom
    from launch.launcher import start_redis

    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    arm_names = [a for a in args.arms.split(",") if a]
    if set(arm_names) - {"split", "colocated"}:
        parser.error(f"--arms: {args.arms!r} names an arm other than split and colocated")
    # `timeout` sends SIGTERM: unwind through the finally blocks (workers stopped, JSON saved)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bulkhead-split-"))
    result: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v)
                                       for k, v in vars(args).items()},
                              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    model = args.model
    if not model:
        from bench.synthetic_model import write_llama

        base = Path(args.model_dir) if args.model_dir else (
            Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp)
        t = time.monotonic()
        model = str(write_llama(base / f"bulkhead-{args.shape}", args.shape, args.device,
                                args.shard_gb))
        result["model_write_s"] = round(time.monotonic() - t, 1)
        if args.device.startswith("cuda"):  # the writer's cached blocks would sit beside the arms
            import torch

            torch.cuda.empty_cache()
    share = args.share_weights if args.share_weights is not None else args.device != "cpu"
    if not args.up:  # workers sized here count blocks of a known size
        args.block_size = args.block_size or 16
    common = ["--device", args.device,
              *(["--block-size", str(args.block_size)] if args.block_size else []),
              "--lmcache-chunk-size", str(args.lmcache_chunk_size), "--kv-visible-timeout-s", "120",
              *args.extra_worker_flag]
    sh = {} if args.up else shapes(args)  # --up: the workers size themselves (settings)
    result["shapes"] = {k: v.__dict__ for k, v in sh.items()}
    workload = Workload(num_chats=args.chats, chat_prompt_chars=args.chat_prompt_chars,
                        output_tokens=args.output_tokens, long_tokens=args.long_tokens,
                        long_every_s=args.long_every_s, first_long_s=args.first_long_s,
                        long_output_tokens=args.long_output_tokens, duration_s=args.duration_s,
                        agent_tools=args.agent_tools)
    redis, redis_url = start_redis(log_dir=out / "logs", maxmemory_mb=args.redis_maxmemory_mb,
                                   io_threads=args.redis_io_threads)
    arms: dict[str, dict[str, Any]] = {}
    json_path = out / "split.json"

    def save() -> None:
        """After every arm: a run cut short later still leaves its figures and plot."""
        body = {**result, "arms": {n: {**{k: v for k, v in a.items() if k != "records"},
                                       "records": [r.to_json() for r in a.get("records", [])]}
                                   for n, a in arms.items()}}
        json_path.write_text(json.dumps(body, default=str))
        done = {n: a for n, a in arms.items() if "records" in a}
        if done:
            try:
                plot(out / "split.png", done)
            except ValueError as exc:  # e.g. no token streamed: the figures still count
                print(f"split.png not drawn: {exc}", flush=True)

    try:
        for name in arm_names:
            t = time.monotonic()
            print(f"[{name}] starting at {time.strftime('%H:%M:%S', time.gmtime())} UTC",
                  flush=True)
            try:
                if args.up:
                    arm = start_with_up(name, _up_options(args, model, name, redis_url,
                                                          out / "logs" / name, common))
                elif name == "split":
                    staging = max(args.long_tokens) * _kv_bytes_per_token(model) / 2**30 + 1
                    flags = [*common, "--kv-staging-gb", f"{staging:.1f}"]
                    arm = start_split(model, redis_url, sh["prefill"], sh["decode"], flags,
                                      tmp / "weights.handle", out / "logs", share=share)
                else:
                    arm = start_colocated(model, sh["colocated"], common, out / "logs")
            except Exception as exc:  # noqa: BLE001 - report the arm that failed, keep the rest
                arms[name] = {"error": repr(exc)[-3000:]}
                save()
                continue
            try:
                arms[name] = run_arm(arm, _served_model(arm.url), workload)
            finally:
                arm.stop()
            arms[name]["wall_s"] = round(time.monotonic() - t, 1)
            arms[name]["redis"] = _redis_figures(redis_url)
            if name == "split":
                arms[name]["resident_check"] = resident_check(arms[name])
            _print_arm(name, arms[name])
            save()
        from bench.split_handoff import host_memcpy_gbps

        longest_bytes = max(args.long_tokens) * _kv_bytes_per_token(model)
        result["host_memcpy"] = {"bytes": longest_bytes,
                                 "gbps": round(host_memcpy_gbps(longest_bytes), 2)}
        if args.handoff_tokens:
            from bench.split_handoff import measure

            try:
                result["handoff"] = measure(model, redis_url, args.handoff_tokens, args.device,
                                            chunk_size=args.lmcache_chunk_size)
            except Exception as exc:  # noqa: BLE001
                result["handoff"] = {"error": repr(exc)[-2000:]}
            print("handoff", json.dumps(result["handoff"]), flush=True)
    finally:
        redis.stop(grace_s=5.0)
        save()
    return 0 if all("error" not in a for a in arms.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
