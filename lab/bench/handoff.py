"""Measures the KV handoff: a prefill worker and a decode worker (separate processes) and a fresh
redis-server on this host, driven over gRPC.

For each trial: the Prefill RPC (compute + KV put + wait until visible); the decode worker's
first chunk after ``has_prefill`` (KV fetched from Redis, copied into its blocks); a similar
prompt computed on the decode worker alone; and the inter-token gaps of a stream already running
on the decode worker while each of the two lands (what disaggregation protects). Per-phase times of
the prefill side come from its log line ``prefill <id>: ... KV put ... visible after ...``.

    python -m lab.bench.handoff --model PATH --prompt-tokens 2000 --trials 2

A measuring tool, never imported by the workers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from common.worker_env import WORKER_ENV
from launch.health import grpc_serving
from launch.launcher import ProcessGroup, free_port, spawn, start_redis, wait_until
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc


def _stream_gaps(stub: pb_grpc.WorkerStub, max_tokens: int, out: list[float]) -> None:
    req = pb.GenerateRequest(prompt_token_ids=[100, 200, 300],
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                        ignore_eos=True))
    last = time.monotonic()
    for _ in stub.Generate(req, timeout=600):
        now = time.monotonic()
        out.append(now - last)
        last = now


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-handoff-"))
    flags = ["--device", args.device, "--max-context", str(args.prompt_tokens + 64),
             "--chunk-tokens", str(args.chunk_tokens), "--max-batch", "3",
             "--lmcache-chunk-size", str(args.lmcache_chunk_size), "--kv-staging-gb",
             str(args.kv_staging_gb), "--num-threads", str(args.num_threads)]
    results = []
    with ProcessGroup() as group:
        redis_proc, url = start_redis(log_dir=log_dir)
        group.add(redis_proc)
        addresses = {}
        for role in ("prefill", "decode"):
            port = free_port()
            addresses[role] = f"127.0.0.1:{port}"
            argv = [sys.executable, "-m", "launch.cli", role, "--model", args.model,
                    "--port", str(port), "--kv-store-url", url, *flags]
            group.add(spawn(role, argv, env=WORKER_ENV, log_dir=log_dir))
        for proc in group.processes[1:]:
            address = addresses[proc.name]
            wait_until(proc, lambda a=address: grpc_serving(a), 900, f"serving on {address}")
        prefill = pb_grpc.WorkerStub(grpc.insecure_channel(addresses["prefill"]))
        decode = pb_grpc.WorkerStub(grpc.insecure_channel(addresses["decode"]))
        sampling = pb.SamplingParams(max_tokens=8, temperature=0)
        for trial in range(args.trials):
            prompt = [(trial * 7919 + i * 31) % 30000 + 100 for i in range(args.prompt_tokens)]
            t0 = time.monotonic()
            resp = prefill.Prefill(pb.PrefillRequest(prompt_token_ids=prompt, sampling=sampling),
                                   timeout=600)
            prefill_s = time.monotonic() - t0
            gaps: list[float] = []
            background = threading.Thread(target=_stream_gaps, args=(decode, 120, gaps))
            background.start()
            time.sleep(1.0)
            t0 = time.monotonic()
            call = decode.Generate(pb.GenerateRequest(
                prompt_token_ids=prompt, sampling=sampling, has_prefill=True,
                first_token_id=resp.first_token_id, kv=resp.kv), timeout=600)
            next(call)
            import_first_s = time.monotonic() - t0
            usage = list(call)[-1].usage
            background.join()
            other = [t + 1 for t in prompt]  # not stored anywhere: computed on the decode worker
            local_gaps: list[float] = []
            background = threading.Thread(target=_stream_gaps, args=(decode, 120, local_gaps))
            background.start()
            time.sleep(1.0)
            t0 = time.monotonic()
            call = decode.Generate(pb.GenerateRequest(prompt_token_ids=other, sampling=sampling),
                                   timeout=600)
            next(call)
            local_first_s = time.monotonic() - t0
            list(call)
            background.join()
            steady, local = sorted(gaps[1:]), sorted(local_gaps[1:])
            results.append({
                "prompt_tokens": args.prompt_tokens, "prefill_rpc_s": prefill_s,
                "kv_tokens_stored": resp.kv.num_tokens_stored,
                "decode_first_chunk_after_import_s": import_first_s,
                "loaded_kv_tokens": usage.loaded_kv_tokens,
                "recomputed_tokens": usage.recomputed_tokens,
                "decode_only_first_token_s": local_first_s,
                "running_stream_itl_median_s": steady[len(steady) // 2],
                "running_stream_itl_max_s": steady[-1],
                "running_stream_itl_max_during_local_prefill_s": local[-1],
            })
    print(f"logs: {log_dir}", file=sys.stderr)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.handoff", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder or .gguf file")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--lmcache-chunk-size", type=int, default=256)
    ap.add_argument("--kv-staging-gb", type=float, default=0.3)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--log-dir", default="")
    args = ap.parse_args(argv)
    for row in run(args):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
