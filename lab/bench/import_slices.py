"""What importing a long prompt's KV costs the decodes running beside it: the engine's step time
while a prompt's fetched KV is copied into its blocks in bounded slices (engine/kv_import_job.py)
against the one-go copy it replaced, on any device.

One engine with a random-weight checkpoint: ``--chats`` short requests decode without end; then
a ``--prompt-tokens`` prompt arrives with its KV already in host memory (random values in the
model dtype, in a host arena like the worker's), and every
``engine.step()`` is timed until that prompt's first token. Each step gives every chat one token,
so the step time is the chats' inter-token latency. Arms: ``oneshot`` (the previous path: a hook
that copies the whole prompt, an LMCache chunk at a time, in the admission step) and one arm per
``--slices-mb`` value, each from a pageable and/or a pinned arena (``--arenas``). No store and no network: the fetch is not what is measured here
(bench/split_handoff.py measures it).

    python -m lab.bench.import_slices --shape kv-heavy --prompt-tokens 16384 --device cpu
    python -m lab.bench.import_slices --shape llama3-8b --prompt-tokens 131072 --device cuda \
        --chats 16 --chat-tokens 4096 --slices-mb 256,64,16 --arenas pageable,pinned
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.synthetic_model import SHAPES, write_llama


def staged_kv(engine: Any, num_tokens: int, pinned: bool) -> Any:
    """The prompt's whole blocks as a fetch leaves them: random values in the model dtype, in a
    region of a host arena (worker/host_staging.py)."""
    from engine.staged_kv import StagedKV
    from worker.host_staging import HostStaging

    layout = engine.kv_layout
    num_blocks = num_tokens // layout.block_size
    arena = HostStaging(num_blocks * layout.bytes_per_block, pin=pinned)
    region = arena.take(num_blocks * layout.bytes_per_block, timeout_s=0)
    rows = region.data.view(num_blocks, layout.bytes_per_block)
    vals = rows.view(engine.config.torch_dtype)
    base = torch.randn(min(64, num_blocks), vals.shape[1]) * 0.5  # tiled: values do not matter
    for i in range(0, num_blocks, base.shape[0]):
        part = vals[i:i + base.shape[0]]
        part.copy_(base[: part.shape[0]])
    return StagedKV(rows, num_blocks * layout.block_size, region=region)


def oneshot_hook(engine: Any, staged: Any, chunk_tokens: int = 256) -> Any:
    """The import as it was: every block in the admission step, an LMCache chunk per copy."""
    layout = engine.kv_layout
    step = chunk_tokens // layout.block_size

    def load(kv: Any, block_ids: list[int], num_prompt_tokens: int, *,
             num_computed_tokens: int = 0) -> int:
        for i in range(0, staged.num_blocks, step):
            j = min(i + step, staged.num_blocks)
            layout.import_blocks(kv, block_ids[i:j], staged.blocks[i:j])
        return staged.num_tokens

    return load


def run_arm(engine: Any, arm: str, staged: Any, prompt: list[int], slice_bytes: int,
            warm_steps: int) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    engine._importer.slice_blocks = max(1, slice_bytes // engine.kv_layout.bytes_per_block)
    source = oneshot_hook(engine, staged) if arm == "oneshot" else staged
    sync = torch.cuda.synchronize if engine.config.torch_device.type == "cuda" else (lambda: None)
    allocs = engine.stats().device_allocs_since_warmup
    before = []
    for _ in range(warm_steps):
        t = time.perf_counter()
        engine.step()
        sync()
        before.append(time.perf_counter() - t)
    engine.add_request(f"long-{arm}", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                       kv_import=source)
    del source
    during, first = [], None
    t_arrive = time.perf_counter()
    while first is None:
        t = time.perf_counter()
        outs = engine.step()
        sync()
        during.append(time.perf_counter() - t)
        first = next((o for o in outs if o.request_id == f"long-{arm}"), None)
    ttft = time.perf_counter() - t_arrive
    # the last step computed the prompt's tail and sampled its token: not part of the import
    importing = during[:-1]
    ms = [1e3 * s for s in importing]
    return {
        "arm": arm, "slice_bytes": None if arm == "oneshot" else slice_bytes,
        "import_steps": len(importing), "imported_tokens": first.num_imported_tokens,
        "step_ms_before_p50": round(1e3 * statistics.median(before), 2),
        "step_ms_importing_p50": round(statistics.median(ms), 2),
        "step_ms_importing_max": round(max(ms), 2),
        "step_ms_after_import": round(1e3 * during[-1], 2),
        "arrival_to_first_token_s": round(ttft, 3),
        # CUDA: device allocations the caching allocator made during the arm (None on a CPU)
        "device_allocs": None if allocs is None
        else engine.stats().device_allocs_since_warmup - allocs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="kv-heavy")
    p.add_argument("--checkpoint", default="", help="an existing checkpoint folder to use")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-tokens", type=int, default=2048,
                   help="each chat's max_tokens: more than the steps of all arms together")
    p.add_argument("--slices-mb", default="64,16", help="comma-separated arms besides oneshot")
    p.add_argument("--device", default="cpu")
    p.add_argument("--arenas", default="pageable",
                   help="pageable,pinned: run every arm from each kind of host arena (pinned: CUDA)")
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    slices = [int(float(s) * 2**20) for s in args.slices_mb.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint or str(write_llama(Path(tmp), args.shape, args.device))
        block = 16
        ctx = max(args.prompt_tokens, args.chat_tokens) + 64
        per_seq = -(-ctx // block)
        ec = EngineConfig(model=folder, device=args.device, max_context=ctx, chunk_tokens=512,
                          max_batch=args.chats + 1, block_size=block,
                          num_blocks=per_seq + args.chats * (args.chat_tokens // block + 2) + 1,
                          kv_import_slice_bytes=max(slices, default=64 << 20),
                          strict_allocations=False)
        t = time.perf_counter()
        engine = LLMEngine.from_config(ec)
        print(f"engine ready in {time.perf_counter() - t:.1f} s: {engine.kv_layout.bytes_per_token:,.0f}"
              f" B of KV a token, prompt {args.prompt_tokens} tokens = "
              f"{args.prompt_tokens * engine.kv_layout.bytes_per_token / 2**20:,.0f} MiB",
              flush=True)
        chat = SamplingParams(max_tokens=args.chat_tokens, temperature=0.0, ignore_eos=True)
        for i in range(args.chats):
            engine.add_request(f"chat{i}", [5 + i, 6, 7, 8, 9, 10, 11, 12], chat)
        rows = []
        k = 0
        for arena in args.arenas.split(","):
            staged = staged_kv(engine, args.prompt_tokens, arena == "pinned")
            # a first import, not reported: the first touch of host pages (the KV extent and
            # the slice buffer on a CPU) and first-use costs of the long context would go to
            # the first arm
            arms = [("warm-up", 0), ("oneshot", 0)] + [(f"{s / 2**20:g}MiB", s) for s in slices]
            for i, (arm, nbytes) in enumerate(arms):
                k += 1  # a new prompt each time: no prefix-cache hit on an earlier arm's blocks
                prompt = [100 + k] + [(7 * j + k) % 200 + 3 for j in range(args.prompt_tokens)]
                row = run_arm(engine, "oneshot" if i == 0 else arm, staged, prompt, nbytes,
                              args.warm_steps)
                if i:
                    rows.append({"arena": arena, **row})
                    print(json.dumps(rows[-1]), flush=True)
            del staged
        result = {"shape": args.checkpoint or args.shape, "device": str(ec.torch_device),
                  "prompt_tokens": args.prompt_tokens,
                  "chats": args.chats,
                  "arms": rows}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
