"""The memory plan of the incident's scenario (:mod:`.incident`): the engine's own ``make_plan``
for one prompt of ``context`` tokens beside ``--decodes`` decoding sequences, and the largest
context whose plan fits. Shared by the run and its report (which plans again by today's
formulas); plans only, never touches a device.
"""

from __future__ import annotations

import argparse

from engine.config import EngineConfig
from engine.memory_plan import MemoryPlan
from engine.memory_planner import make_plan
from engine.model_config import ModelConfig
from engine.models.deepseek_v4.config import DeepseekV4Config
from lab.bench.deepseek_v4.hf_config import hf_dict
from lab.bench.deepseek_v4.quantized_weights import quantized_hf_config


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_for(cfg: DeepseekV4Config, context: int, args: argparse.Namespace, weight_bytes: int,
             device_bytes: int) -> tuple[MemoryPlan, EngineConfig, list[int]]:
    """The engine's plan for the scenario at ``context``, and the block count of each slot."""
    mc = ModelConfig.from_hf_dict(quantized_hf_config(hf_dict(cfg)), name="synthetic-v4-flash")
    dec_len = args.decode_context + _cdiv(context, args.chunk - args.decodes) + 8
    per_slot = [_cdiv(context, args.block_size)] + [_cdiv(dec_len, args.block_size)] * args.decodes
    ec = EngineConfig(
        model="synthetic-v4-flash", device=args.device, dtype="bfloat16", max_context=context,
        chunk_tokens=args.chunk, max_batch=1 + args.decodes, block_size=args.block_size,
        attn_tile_tokens=args.block_size, num_blocks=1 + sum(per_slot), kv_dtype=args.kv_dtype,
        device_memory_bytes=device_bytes, memory_utilization=args.memory_utilization,
    )
    return make_plan(mc, ec, device_bytes, weight_bytes=weight_bytes), ec, per_slot


def largest_context(cfg: DeepseekV4Config, args: argparse.Namespace, weight_bytes: int,
                    device_bytes: int) -> int:
    """The largest context (a multiple of the block size, <= --target) whose plan fits."""
    lo, hi = 0, args.target // args.block_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan_for(cfg, mid * args.block_size, args, weight_bytes, device_bytes)[0].fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * args.block_size
