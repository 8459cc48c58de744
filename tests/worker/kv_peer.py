"""A separate OS process that stores or retrieves KV through worker.kv_store (test helper).

Usage: python tests/worker/kv_peer.py SPEC.json OUT.pt.  SPEC holds the store URL, the dense
layout's shapes (block size included: both sides page alike) and optionally its kv_dtype,
and a list of operations; OUT receives a dict of results (tensors and counts) for the test to
check. Kept out of the pytest process because LMCache starts threads and changes the
multiprocessing start method.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.models.dense_family import DenseKVLayout
from worker.host_staging import HostStaging
from worker.kv_store import KVStore


def dense_layout(spec: dict) -> DenseKVLayout:
    """The engine's paged K/V layout for the spec's shapes (a llama-shaped ModelConfig)."""
    heads, dim = spec["num_kv_heads"], spec["head_dim"]
    mc = ModelConfig(family="llama", vocab_size=32, hidden_size=heads * dim, intermediate_size=8,
                     num_layers=spec["num_layers"], num_heads=heads, num_kv_heads=heads,
                     head_dim=dim)
    ec = EngineConfig(model="peer", device="cpu", dtype=spec["dtype"],
                      block_size=spec["block_size"], kv_dtype=spec.get("kv_dtype", "auto"))
    return DenseKVLayout(mc, ec)


def paged_from_tokens(layout: DenseKVLayout, kv_tokens: torch.Tensor, block_ids: list[int],
                      num_blocks: int):  # noqa: ANN201 - engine.kv_cache.KVCache
    """Scatter per-token KV [L, 2, n, H, D] into a fresh KVCache (NaN elsewhere)."""
    kv = layout.allocate(num_blocks, torch.device("cpu"))
    kv.data.fill_(float("nan"))
    bs = layout.block_size
    for i in range(kv_tokens.shape[2]):
        kv.data[:, :, block_ids[i // bs], i % bs] = kv_tokens[:, :, i]
    return kv


def gather_tokens(paged: torch.Tensor, block_ids: list[int], n: int) -> torch.Tensor:
    """Tokens [0, n) as [L, 2, n, H, D] fp32 (an FP8 cache upcast: exact, NaN kept)."""
    paged = paged.float()
    block_size = paged.shape[3]
    n = min(n, len(block_ids) * block_size)
    return torch.stack(
        [paged[:, :, block_ids[i // block_size], i % block_size] for i in range(n)], dim=2)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("log_level"):  # tests that read the peer's logs (no secret may appear)
        logging.basicConfig(level=spec["log_level"].upper())
    layout = dense_layout(spec)
    store = KVStore(spec["url"], spec["model_name"], layout, chunk_size=spec["chunk_size"],
                    staging_gb=0.05, ttl_s=spec.get("ttl_s", 3600))
    results: dict[str, object] = {"layout_fingerprint": store.layout_fingerprint}
    try:
        for op in spec["ops"]:
            name, tokens = op["name"], op["tokens"]
            if op["kind"] == "store":
                kv_tokens = torch.load(op["kv_path"])
                kv = paged_from_tokens(layout, kv_tokens, op["block_ids"], op["num_blocks"])
                results[name] = store.store(tokens, kv, op["block_ids"], timeout_s=10.0)
                results[name + ".keys"] = store.chunk_keys(store.stored_prefix(tokens))
            elif op["kind"] == "retrieve":
                kv = layout.allocate(op["num_blocks"], torch.device("cpu"))
                kv.data.fill_(float("nan"))
                n = store.retrieve(tokens, kv, op["block_ids"],
                                   skip_tokens=op.get("skip_tokens", 0))
                results[name] = n
                results[name + ".kv"] = gather_tokens(kv.data, op["block_ids"], len(tokens))
                # Blocks outside the table must stay untouched.
                others = [b for b in range(op["num_blocks"]) if b not in op["block_ids"]]
                results[name + ".others_untouched"] = bool(
                    kv.data[:, :, others].float().isnan().all())
            elif op["kind"] == "fetch":
                if "arena_bytes" in op:  # a smaller host staging than the store's own
                    store._staging = HostStaging(op["arena_bytes"], pin=False)
                n, staged = store.fetch(tokens)
                results[name] = n
                results[name + ".kv"] = None
                if staged is not None:
                    kv = layout.allocate(staged.num_blocks + 1, torch.device("cpu"))
                    ids = list(range(1, staged.num_blocks + 1))
                    store.import_staged(kv, ids, staged, 0, n)
                    results[name + ".kv"] = gather_tokens(kv.data, ids, n)
            elif op["kind"] == "lookup":
                results[name] = store.lookup(tokens)
            elif op["kind"] == "wait_visible":
                t = time.monotonic()
                results[name] = store.wait_visible(tokens, op["timeout_s"], op.get("stall_s"))
                results[name + ".s"] = time.monotonic() - t
            else:
                raise ValueError(op["kind"])
    finally:
        store.close()
    torch.save(results, sys.argv[2])


if __name__ == "__main__":
    main()
