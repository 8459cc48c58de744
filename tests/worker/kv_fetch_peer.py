"""A separate OS process (test helper) that stores one long prompt through worker.kv_store, then
fetches it on one thread while another thread looks up other prompts, timing both.

Usage: python tests/worker/kv_fetch_peer.py SPEC.json OUT.pt. SPEC: the store URL, the dense
layout's shapes (tests/worker/kv_peer.py), ``num_tokens`` of the long prompt. OUT: the fetch's
start/end, each lookup's start/end/answer, and whether the fetched bytes equal the stored ones.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

from tests.worker.kv_peer import dense_layout
from worker.kv_store import KVStore


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    layout = dense_layout(spec)
    store = KVStore(spec["url"], spec["model_name"], layout, chunk_size=spec["chunk_size"],
                    staging_gb=spec["staging_gb"], ttl_s=600)
    n = spec["num_tokens"]
    long_prompt = [1 + (i * 7919) % 30000 for i in range(n)]
    num_blocks = n // layout.block_size
    kv = layout.allocate(num_blocks, torch.device("cpu"))
    kv.data.view(torch.uint8).random_(generator=torch.Generator().manual_seed(3))
    blocks = list(range(num_blocks))
    out: dict[str, object] = {}
    try:
        out["visible"] = store.store(long_prompt, kv, blocks, timeout_s=120.0)
        started = threading.Event()
        fetched: dict[str, object] = {}

        def fetch() -> None:
            started.set()
            fetched["start"] = time.monotonic()
            fetched["n"], fetched["staged"] = store.fetch(long_prompt)
            fetched["end"] = time.monotonic()

        thread = threading.Thread(target=fetch)
        thread.start()
        started.wait()
        time.sleep(0.02)  # test side only: let the fetch get under way
        lookups = []
        others = ([50_000 + i for i in range(40)],  # a miss: nothing stored
                  long_prompt[: 2 * spec["chunk_size"]])  # a hit: the long prompt's prefix
        i = 0
        while thread.is_alive():
            t0 = time.monotonic()
            got = store.lookup(others[i % 2])
            lookups.append((t0, time.monotonic(), got, i % 2))
            i += 1
        thread.join()
        out.update(fetch_start=fetched["start"], fetch_end=fetched["end"], lookups=lookups,
                   fetched=fetched["n"])
        staged = fetched["staged"]
        out["equal"] = staged is not None and torch.equal(
            staged.blocks, layout.export_blocks(kv, blocks))
    finally:
        store.close()
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
