"""DeepSeek-V4 KV handoff through LMCache at the incident's prompt lengths: bytes moved per token
and the time of each leg, against the host memcpy rate measured in the same run.

For each prompt length: a V4-Flash-shaped pool (``--config``, default the real 43-layer
config's layout; only the KV layout matters here, no weights are built) holds the prompt's
blocks filled with random bytes on the device, SYNTHESISED at full size rather than computed
by a prefill (a 255k-token V4-Flash prefill is not what this measures), plus random window
snapshots where a prefill in ``--prefill-chunk``-token steps leaves them (the last block end
each step reaches; the pool keeps the newest ``4 x --max-batch``, resume_windows.py). A
"prefill" KVStore puts them (blocks through LMCache, each resume point's window as its own Redis
key) and waits until they are visible in the remote store; a second "decode" KVStore (its own
LMCache engine) fetches the longest stored prefix that ends at a resume point, with that one
window, into host memory and imports it into other blocks of a second pool. The imported blocks
and window are compared byte for byte with the exported ones, and the decode side must be able
to resume at the end of the last block. Bytes moved: the blocks plus the windows the prefill
side stored (``stored_*``), and the blocks plus the one window the decode side fetched
(``fetched_*``). The remote store is a redis-server when one is installed (``--store-url`` to
use another; an ``lm://`` store has no place for windows: nothing is resumable). ``--tiny`` runs
the same path on a toy config on the CPU (a smoke test).

Usage: python -m lab.bench.deepseek_v4.handoff --out handoff_v4.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.models.family import family_class

INCIDENT_PROMPTS = (149_760, 212_992, 255_549)
REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = {
    "model_type": "deepseek_v4", "vocab_size": 101, "hidden_size": 32,
    "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
    "head_dim": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "num_experts_per_tok": 2,
    "n_routed_experts": 4, "hc_mult": 2, "sliding_window": 8, "o_groups": 2, "o_lora_rank": 8,
    "index_n_heads": 4, "index_head_dim": 8, "index_topk": 4,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"],
}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _allocs(dev: torch.device) -> int | None:
    return torch.cuda.memory_stats(dev).get("num_device_alloc", 0) if dev.type == "cuda" else None


def memcpy_rates(nbytes: int, dev: torch.device) -> dict[str, float]:
    """GB/s of a host->host copy and (CUDA) device->host and host->device copies of ``nbytes``."""
    a = torch.empty(nbytes, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    b.copy_(a)
    out = {"host_to_host_GBps": nbytes / (time.perf_counter() - t) / 1e9}
    if dev.type == "cuda":
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        for name, (dst, src) in {"host_to_device_GBps": (d, a),
                                 "device_to_host_GBps": (b, d)}.items():
            dst.copy_(src)
            _sync(dev)
            t = time.perf_counter()
            dst.copy_(src)
            _sync(dev)
            out[name] = nbytes / (time.perf_counter() - t) / 1e9
        del d
    return out


def prefill_resume_points(num_tokens: int, block_size: int, chunk: int) -> list[int]:
    """Block ends where a prefill of ``num_tokens`` in ``chunk``-token steps takes a window
    snapshot: the last block end each step reaches, in order."""
    ends = []
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens) // block_size * block_size
        if end > start:
            ends.append(end)
    return ends


def run(args: argparse.Namespace) -> dict[str, Any]:
    from launch.launcher import redis_server_path, start_kv_server, start_redis
    from worker.kv_store import KVStore

    dev = torch.device(args.device)
    raw = TINY_CONFIG if args.tiny else json.loads(Path(args.config).read_text())
    mc = ModelConfig.from_hf_dict(raw, name="v4-handoff-bench")
    prompts = [int(p) for p in args.prompts.split(",")]
    ec = EngineConfig(model="bench", device=args.device, dtype=args.dtype,
                      block_size=args.block_size, attn_tile_tokens=args.block_size,
                      max_context=max(prompts) + 1, kv_dtype=args.kv_dtype,
                      max_batch=args.max_batch)
    layout = family_class(mc).kv_layout(mc, ec)
    bs, bpb, wb = layout.block_size, layout.bytes_per_block, layout.resume_state_bytes
    num_blocks = 1 + math.ceil(max(prompts) / bs)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "config": "tiny" if args.tiny else args.config,
        "layers": mc.num_layers, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
        "block_size": bs, "bytes_per_block": bpb, "bytes_per_token": bpb / bs,
        "resume_state_bytes": wb, "prefill_chunk": args.prefill_chunk,
        "max_batch": args.max_batch,
        "kinds": [vars(k) for k in layout.kinds], "chunk_size": args.chunk, "rows": []}
    src = layout.allocate(num_blocks, dev)
    dst = layout.allocate(num_blocks, dev)
    for t in src.block_tensors():
        t.view(torch.uint8).random_()
    server = None
    url = args.store_url
    log_dir = Path(args.log_dir) if args.log_dir else None
    if not url and redis_server_path() is not None:  # room for every prompt: no LRU eviction
        server, url = start_redis(log_dir=log_dir, maxmemory_mb=args.redis_maxmemory_mb)
    elif not url:
        server, url = start_kv_server(log_dir=log_dir)
    res["store"] = url.split("://")[0]
    res["memcpy"] = memcpy_rates(min(bpb * (num_blocks - 1), args.memcpy_bytes), dev)
    name = f"v4-handoff-{int(time.time())}"
    prefill = KVStore(url, name, layout, chunk_size=args.chunk, staging_gb=args.staging_gb)
    decode = KVStore(url, name, layout, chunk_size=args.chunk, staging_gb=args.staging_gb)
    try:
        gen = torch.Generator().manual_seed(0)
        for n in prompts:
            tokens = torch.randint(0, 100_000, (n,), generator=gen).tolist()
            blocks = list(range(1, 1 + n // bs))
            targets = list(reversed(blocks))  # other blocks on the decode side
            src.reset_windows()
            dst.reset_windows()
            # the windows a prefill in steps of prefill_chunk leaves (the pool keeps the newest)
            for end in prefill_resume_points(n, bs, args.prefill_chunk):
                window = torch.empty(wb, dtype=torch.uint8, device=dev).random_()
                layout.import_resume_state(src, blocks[end // bs - 1], window)
            sent0 = prefill.resume_bytes_sent
            allocs0 = _allocs(dev)
            _sync(dev)
            t0 = time.perf_counter()
            prefill.put(tokens, src, blocks)
            t1 = time.perf_counter()
            visible = prefill.wait_visible(tokens, args.visible_timeout_s)
            t2 = time.perf_counter()
            loaded, staged = decode.fetch(tokens)
            t3 = time.perf_counter()
            if staged is not None:
                decode.import_staged(dst, targets, staged, 0, loaded)
            _sync(dev)
            t4 = time.perf_counter()
            k = loaded // bs
            same = bool(staged is not None and torch.equal(
                layout.export_blocks(dst, targets[:k]).cpu(), layout.export_blocks(src, blocks[:k]).cpu()))
            if k:
                got_w = layout.export_resume_state(dst, targets[k - 1])
                same = same and got_w is not None and torch.equal(
                    got_w.cpu(), layout.export_resume_state(src, blocks[k - 1]).cpu())
            resumable = layout.resumable_tokens(dst, targets, loaded) if staged is not None else 0
            stored_w = prefill.resume_bytes_sent - sent0
            stored = (n // bs) * bpb + stored_w
            fetched = k * bpb + (wb if staged is not None and staged.resume is not None else 0)
            res["rows"].append({
                "prompt_tokens": n, "stored_tokens": visible, "loaded_tokens": loaded,
                "resumable_tokens": resumable, "recompute_tokens": n - resumable,
                "stored_window_bytes": stored_w, "stored_bytes": stored,
                "stored_bytes_per_token": stored / max(n // bs * bs, 1),
                "fetched_bytes": fetched, "fetched_bytes_per_token": fetched / max(loaded, 1),
                "bit_exact": same,
                "put_s": t1 - t0, "visible_s": t2 - t1, "fetch_s": t3 - t2, "import_s": t4 - t3,
                "handoff_s": t4 - t0,
                "store_GBps": stored / (t2 - t0) / 1e9 if t2 > t0 else None,
                "load_GBps": fetched / (t4 - t2) / 1e9 if t4 > t2 else None,
                "device_allocs_during_handoff": None if allocs0 is None else _allocs(dev) - allocs0,
            })
            print(json.dumps(res["rows"][-1]), flush=True)
    finally:
        prefill.close()
        decode.close()
        if server is not None:
            server.stop(grace_s=5.0)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.bench.deepseek_v4.handoff", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "tests/data/deepseek-v4-flash-config.json"))
    ap.add_argument("--prompts", default=",".join(map(str, INCIDENT_PROMPTS)))
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--kv-dtype", default="fp8", choices=["auto", "fp8"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=1024, help="LMCache chunk (tokens)")
    ap.add_argument("--prefill-chunk", type=int, default=4096,
                    help="the prefill's step (the incident's 4096): where windows are left")
    ap.add_argument("--max-batch", type=int, default=4, help="sizes the pool's window slabs")
    ap.add_argument("--staging-gb", type=float, default=8.0, help="LMCache's host staging pool")
    ap.add_argument("--store-url", default=None, help="redis://... (default: start one)")
    ap.add_argument("--redis-maxmemory-mb", type=int, default=8192,
                    help="the started redis-server's bound (LRU beyond it)")
    ap.add_argument("--visible-timeout-s", type=float, default=600.0)
    ap.add_argument("--memcpy-bytes", type=int, default=1 << 30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--tiny", action="store_true", help="toy config on the CPU (smoke test)")
    ap.add_argument("--out", default="handoff_v4.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.device, args.dtype, args.block_size = "cpu", "float32", 16
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
