"""A separate OS process that stores or retrieves KV through worker.kv_store (test helper).

Usage: python tests/worker/kv_peer.py SPEC.json OUT.pt.  SPEC holds the store URL, the layout,
and a list of operations; OUT receives a dict of results (tensors and counts) for the test to
check. Kept out of the pytest process because LMCache starts threads and changes the
multiprocessing start method.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from worker.kv_store import KVStore


def paged_from_tokens(kv_tokens: torch.Tensor, block_ids: list[int], num_blocks: int,
                      block_size: int) -> torch.Tensor:
    """Scatter per-token KV [L, 2, n, H, D] into a fresh paged tensor by block table."""
    num_layers, _, n, heads, dim = kv_tokens.shape
    paged = torch.full((num_layers, 2, num_blocks, block_size, heads, dim), float("nan"),
                       dtype=kv_tokens.dtype)
    for i in range(n):
        paged[:, :, block_ids[i // block_size], i % block_size] = kv_tokens[:, :, i]
    return paged


def gather_tokens(paged: torch.Tensor, block_ids: list[int], n: int) -> torch.Tensor:
    block_size = paged.shape[3]
    return torch.stack(
        [paged[:, :, block_ids[i // block_size], i % block_size] for i in range(n)], dim=2)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dtype = getattr(torch, spec["dtype"])
    if spec.get("log_level"):  # tests that read the peer's logs (no secret may appear)
        logging.basicConfig(level=spec["log_level"].upper())
    store = KVStore(spec["url"], spec["model_name"], spec["num_layers"], spec["num_kv_heads"],
                    spec["head_dim"], dtype, chunk_size=spec["chunk_size"], staging_gb=0.05,
                    ttl_s=spec.get("ttl_s", 3600))
    results: dict[str, object] = {"layout_fingerprint": store.layout_fingerprint}
    try:
        for op in spec["ops"]:
            name, tokens = op["name"], op["tokens"]
            if op["kind"] == "store":
                kv_tokens = torch.load(op["kv_path"])
                paged = paged_from_tokens(kv_tokens, op["block_ids"], op["num_blocks"],
                                          op["block_size"])
                results[name] = store.store(tokens, paged, op["block_ids"], timeout_s=10.0)
                results[name + ".keys"] = store.chunk_keys(tokens)
            elif op["kind"] == "retrieve":
                paged = torch.full((spec["num_layers"], 2, op["num_blocks"], op["block_size"],
                                    spec["num_kv_heads"], spec["head_dim"]), float("nan"),
                                   dtype=dtype)
                n = store.retrieve(tokens, paged, op["block_ids"],
                                   skip_tokens=op.get("skip_tokens", 0))
                results[name] = n
                results[name + ".kv"] = gather_tokens(paged, op["block_ids"], len(tokens))
                # Blocks outside the table must stay untouched.
                others = [b for b in range(op["num_blocks"]) if b not in op["block_ids"]]
                results[name + ".others_untouched"] = bool(paged[:, :, others].isnan().all())
            elif op["kind"] == "fetch":
                n, staged = store.fetch(tokens)
                results[name] = n
                results[name + ".kv"] = None if staged is None else staged[:, :, 0]
            elif op["kind"] == "lookup":
                results[name] = store.lookup(tokens)
            else:
                raise ValueError(op["kind"])
    finally:
        store.close()
    torch.save(results, sys.argv[2])


if __name__ == "__main__":
    main()
