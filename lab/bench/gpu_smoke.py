"""``python -m lab.bench.gpu_smoke OUT_DIR``: does the split stack start on this GPU machine?

Checks, each on its own (one failing does not hide the others), and writes ``smoke.json``:
the versions of what the carried wheels bring; whether LMCache's compiled CUDA ops load
against this torch; a KVStore round trip through a real redis-server from device KV blocks; and
a whole deployment (`bulkhead up`: redis, prefill + decode sharing one copy of a tiny random
model's weights, router) answering a streamed chat that goes through the split. Minutes, not
more; run by scripts/gpu_stack.sh smoke.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _section(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    t = time.monotonic()
    try:
        results[name] = {"ok": True, "result": fn()}
    except BaseException as exc:  # noqa: BLE001 - a smoke test reports every failure
        results[name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-3000:]}
    results[name]["seconds"] = round(time.monotonic() - t, 2)
    print(name, json.dumps(results[name])[:2000], flush=True)


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda": torch.cuda.is_available(),
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                           else None}
    for dist in ("lmcache", "redis", "fastapi", "uvicorn", "grpcio", "protobuf", "pydantic",
                 "tokenizers", "transformers", "numpy", "uvloop", "httpx"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import lmcache.cuda_ops  # noqa: F401
        out["lmcache_cuda_ops"] = "loaded"
    except ImportError as exc:
        out["lmcache_cuda_ops"] = f"not loadable: {exc}"[:300]
    for folder in ("/dev/shm", "/tmp"):
        usage = shutil.disk_usage(folder)
        out[f"disk_free_gb {folder}"] = round(usage.free / 2**30, 1)
    return out


def kv_round_trip(tmp: Path) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.model_config import ModelConfig
    from engine.models.dense_family import DenseKVLayout
    from launch.launcher import start_redis
    from worker.kv_store import KVStore

    mc = ModelConfig(family="llama", vocab_size=32, hidden_size=1024, intermediate_size=8,
                     num_layers=4, num_heads=8, num_kv_heads=8, head_dim=128)
    layout = DenseKVLayout(mc, EngineConfig(model="x", device="cuda", dtype="bfloat16"))
    proc, url = start_redis(log_dir=tmp, maxmemory_mb=512)
    try:
        store = KVStore(url, "smoke", layout, chunk_size=256, staging_gb=0.1)
        kv = layout.allocate(40, torch.device("cuda"))
        kv.data.view(torch.uint8).random_()
        tokens = list(range(1000, 1000 + 1024))
        blocks = list(range(1, 1 + 1024 // layout.block_size))
        stored = store.store(tokens, kv, blocks)
        n, staged = store.fetch(tokens)
        same = bool(torch.equal(staged.blocks.cuda(), layout.export_blocks(kv, blocks)))
        store.close()
    finally:
        proc.stop(grace_s=3.0)
    return {"stored": stored, "fetched": n, "bytes_equal": same}


def shared_deployment(tmp: Path, out: Path) -> dict[str, Any]:
    import httpx

    from bench.synthetic_model import write_llama
    from launch.launcher import free_port
    from launch.up import start
    from launch.up_options import UpOptions

    model = write_llama(tmp / "tiny", "tiny", device="cuda")
    handle = tmp / "weights.handle"
    flags = ("--device", "cuda", "--max-context", "2048", "--chunk-tokens", "256",
             "--max-batch", "4", "--lmcache-chunk-size", "256", "--kv-staging-gb", "0.1",
             "--share-weights", str(handle), "--memory-utilization", "0.2",
             "--strict-allocations")
    dep = start(UpOptions(model=str(model), port=free_port(), log_dir=str(out / "logs"),
                          startup_timeout_s=300, extra_worker_args=flags))
    try:
        body = {"model": dep.model_name, "max_tokens": 32, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "x" * 900}]}
        t0 = time.monotonic()
        chunks = 0
        with httpx.stream("POST", dep.url + "/v1/chat/completions", json=body,
                          timeout=120) as resp:
            status = resp.status_code
            for line in resp.iter_lines():
                chunks += line.startswith("data: {")
        elapsed = time.monotonic() - t0
        metrics = httpx.get(dep.url + "/metrics", timeout=10).text
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv"], capture_output=True, text=True).stdout
    finally:
        dep.stop()
    logs = {p.name: p.read_text()[-4000:] for p in (out / "logs").glob("*.log")}
    said = {name: [ln for ln in text.splitlines() if "weights" in ln][-4:]
            for name, text in logs.items()}
    splits = [ln for ln in metrics.splitlines() if "route" in ln and not ln.startswith("#")][:8]
    return {"status": status, "chunks": chunks, "seconds": round(elapsed, 2),
            "startup_s": round(dep.startup_s, 1), "weight_lines": said, "routes": splits,
            "nvidia_smi": smi}


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bulkhead-smoke-"))
    results: dict[str, Any] = {}
    _section(results, "versions", versions)
    _section(results, "kv_round_trip", lambda: kv_round_trip(tmp))
    _section(results, "shared_deployment", lambda: shared_deployment(tmp, out))
    (out / "smoke.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
