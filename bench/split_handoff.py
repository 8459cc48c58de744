"""The KV handoff alone, for one long prompt: its whole blocks (random bytes, the model's dense
layout) put through a KVStore into Redis until visible, fetched back into host memory, and
imported into device blocks; beside a host memcpy of the same bytes in the same process.
What a split pays per long prompt, without the model's compute in the way.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def host_memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Best of ``repeats`` copies between two pageable host buffers of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def measure(model: str, redis_url: str, num_tokens: int, device: str,
            chunk_size: int = 0, dtype: str = "bfloat16",
            visible_timeout_s: float = 600.0, stall_s: float = 30.0,
            fetch_connections: int = 4) -> dict[str, Any]:
    from engine.checkpoint import load_model_config
    from engine.config import EngineConfig
    from engine.models.family import family_class
    from worker.kv_store import KVStore

    cfg = load_model_config(model)
    ec = EngineConfig(model=model, device=device, dtype=dtype)
    layout = family_class(cfg).kv_layout(cfg, ec)
    num_blocks = num_tokens // layout.block_size
    tokens = [1000 + (i * 7919) % 100000 for i in range(num_blocks * layout.block_size)]
    kv = layout.allocate(num_blocks + 1, ec.torch_device)
    for t in ([kv.data] if hasattr(kv, "data") else []):
        t.view(torch.uint8).random_()
    blocks = list(range(1, num_blocks + 1))
    nbytes = num_blocks * layout.bytes_per_block
    if not chunk_size:  # as a worker chooses it
        from worker.kv_store_config import auto_chunk_tokens

        chunk_size = auto_chunk_tokens(layout.block_size, layout.bytes_per_block)
    store = KVStore(redis_url, "handoff-bench", layout, chunk_size=chunk_size,
                    staging_gb=nbytes / 2**30 + 0.5, ttl_s=600,
                    fetch_connections=fetch_connections)
    held: dict[str, Any] = {}
    try:
        before = _redis_used(redis_url)
        t0 = time.perf_counter()
        store.put(tokens, kv, blocks)
        t1 = time.perf_counter()
        visible = store.wait_visible(tokens, timeout_s=visible_timeout_s, stall_s=stall_s)
        t2 = time.perf_counter()
        held = _redis_held(redis_url, store, tokens, before)
        got, staged = store.fetch(tokens)
        t3 = time.perf_counter()
        dst = layout.allocate(num_blocks + 1, ec.torch_device)
        if staged is not None:
            store.import_staged(dst, blocks, staged, 0, got)
        if ec.torch_device.type == "cuda":
            torch.cuda.synchronize()
        t4 = time.perf_counter()
        # compared where the blocks are (16 GiB each at 128k: no host copies of them)
        same = staged is not None and bool(torch.equal(
            layout.export_blocks(dst, blocks), layout.export_blocks(kv, blocks)))
    finally:
        store.close()
    gb = nbytes / 1e9
    return {
        "tokens": len(tokens), "chunk_tokens": chunk_size, "fetch_connections": fetch_connections,
        "bytes": nbytes, "bytes_per_token": nbytes / len(tokens),
        "visible_tokens": visible, "fetched_tokens": got, "round_trip_equal": same,
        "put_s": round(t1 - t0, 3), "visible_s": round(t2 - t1, 3), "fetch_s": round(t3 - t2, 3),
        "import_s": round(t4 - t3, 3),
        "put_until_visible_gbps": round(gb / (t2 - t0), 2),
        "fetch_gbps": round(gb / (t3 - t2), 2),
        "import_gbps": round(gb / max(t4 - t3, 1e-9), 2),
        "host_memcpy_gbps": round(host_memcpy_gbps(min(nbytes, 8 << 30)), 2),
        **held,
    }


def _redis_used(url: str) -> int | None:
    """Redis's ``used_memory`` (what ``maxmemory`` is compared with); None for another store."""
    if not url.startswith(("redis://", "rediss://")):
        return None
    import redis

    return int(redis.Redis.from_url(url, socket_timeout=30).info("memory")["used_memory"])


def _redis_held(url: str, store: Any, tokens: list[int], before: int | None) -> dict[str, Any]:
    """What Redis counts for the stored prompt once it is visible: ``used_memory`` grown since
    the put began (the values plus the clients' query buffers still held), and one chunk's
    allocation (``MEMORY USAGE``) over its bytes."""
    if before is None:
        return {}
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30)
    key = store.chunk_keys(tokens)[0][2] + "kv_bytes"
    value, usage = client.strlen(key), client.memory_usage(key)
    return {"redis_used_memory_growth": int(client.info("memory")["used_memory"]) - before,
            "redis_chunk_value_bytes": value,
            "redis_chunk_held_over_value": round(usage / value, 4) if value else None}


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.split_handoff --shape llama3-8b --tokens 4096 --device cpu``: one
    handoff against a fresh redis-server (or ``--store-url``), its figures printed as JSON."""
    import argparse
    import json
    import tempfile
    from pathlib import Path

    from bench.synthetic_model import SHAPES

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk", type=int, default=0,
                   help="LMCache chunk (tokens; 0: as a worker chooses it from the KV layout)")
    p.add_argument("--store-url", default=None, help="redis://... (default: start one)")
    p.add_argument("--fetch-connections", type=int, default=4,
                   help="connections the fetch reads over (a worker's kv_fetch_connections)")
    p.add_argument("--redis-io-threads", type=int, default=1,
                   help="io-threads of the redis-server started here")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        # only the model's shape matters: a config.json, no weights
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", **SHAPES[args.shape]}
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        redis = None
        url = args.store_url
        if url is None:
            from launch.launcher import start_redis

            nbytes = args.tokens * 2 * config["num_hidden_layers"] * \
                config["num_key_value_heads"] * config.get("head_dim", 128) * 2
            redis, url = start_redis(maxmemory_mb=max(1024, 3 * nbytes >> 20),
                                     log_dir=Path(tmp), io_threads=args.redis_io_threads)
        try:
            result = measure(tmp, url, args.tokens, args.device, chunk_size=args.chunk,
                             visible_timeout_s=120.0, fetch_connections=args.fetch_connections)
        finally:
            if redis is not None:
                redis.stop(grace_s=5.0)
    result["shape"] = args.shape
    result["redis_io_threads"] = args.redis_io_threads if args.store_url is None else None
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if result["round_trip_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
