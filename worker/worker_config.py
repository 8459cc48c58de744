"""A worker's settings split by who uses them: the engine's frozen ``EngineConfig``, the KV
store's ``StoreSettings`` and the process's own (network, registry, auth, logging).

Built once at start-up from ``WorkerSettings`` (common/settings.py, torch-free so that
``--help`` and the launcher stay light); from here on each part is handed only to its user.
The settings whose 0 means "by device" are fixed here, where the device is known: the KV extent
(``kv_tokens``) and the import slice. On the CPU they are sized for a laptop, where the plan is
the same RAM as everything else: ``bulkhead up`` with no arguments fits 2 GB there (README).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.settings import StoreSettings, WorkerSettings
from engine.config import EngineConfig, KernelChoices
from engine.config_resolve import CPU_AUTO_KV_TOKENS

MiB = 1 << 20
IMPORT_SLICE_MB = {"cuda": 64.0, "cpu": 16.0}  # kv_import_slice_mb = 0
STAGING_GB_CUDA = 0.5  # kv_staging_gb = 0 on CUDA; on the CPU: one sequence's KV (staging_gb)


@dataclass(frozen=True)
class WorkerConfig:
    settings: WorkerSettings  # with ``model`` resolved
    engine: EngineConfig
    store: StoreSettings | None  # None: no KV store (a decode worker then computes every prompt)

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> WorkerConfig:
        """Resolve the default model and build the engine's and the store's configs."""
        if not settings.model:
            from common.default_model import default_model_path

            settings = dataclasses.replace(settings, model=str(default_model_path()))
        s = settings
        engine = EngineConfig(
            model=s.model, device=s.device, dtype=s.dtype, weight_format=s.weight_format,
            max_context=s.max_context_tokens,  # 0 = auto (engine/config_resolve.py)
            chunk_tokens=s.chunk_tokens, max_batch=s.max_batch, block_size=s.block_size,
            num_blocks=s.num_blocks or None,  # 0 = sized for every sequence at max_context
            attn_tile_tokens=s.attn_tile_tokens, max_queue=s.max_queue,
            enable_prefix_cache=s.enable_prefix_cache,
            device_memory_bytes=int(s.device_memory_gb * (1 << 30)) or None,
            memory_utilization=s.memory_utilization, strict_allocations=s.strict_allocations,
            cuda_graphs=s.cuda_graphs,
            seed=s.seed, share_weights=s.share_weights,
            share_weights_timeout_s=s.share_weights_timeout_s,
            tensor_parallel_size=s.tensor_parallel_size,
            kv_tokens=s.kv_tokens,
            kv_dtype=s.kv_cache_dtype, load_format=s.load_format, memory_share=s.memory_share,
            kernels=KernelChoices(indexer=s.indexer_backend, attention=s.sparse_attention_backend,
                                  gemm=s.quant_gemm_backend, mhc=s.mhc_backend,
                                  decode=s.decode_loop, lanes=s.decode_lanes))
        cpu = engine.torch_device.type == "cpu"
        slice_mb = s.kv_import_slice_mb or IMPORT_SLICE_MB["cpu" if cpu else "cuda"]
        engine = dataclasses.replace(
            engine, kv_import_slice_bytes=max(1, int(slice_mb * MiB)),
            kv_tokens=s.kv_tokens or (CPU_AUTO_KV_TOKENS if cpu else 0))
        return cls(settings, engine, settings.store)


def staging_gb(store: StoreSettings, engine: EngineConfig, bytes_per_token: float,
               chunk_tokens: int) -> float:
    """``kv_staging_gb``, its 0 resolved: 0.5 on CUDA; on the CPU one ``max_context`` sequence's
    KV (``engine`` resolved) in whole LMCache chunks of ``chunk_tokens``, and one chunk more."""
    if store.staging_gb:
        return store.staging_gb
    if engine.torch_device.type != "cpu":
        return STAGING_GB_CUDA
    tokens = (-(-engine.max_context // chunk_tokens) + 1) * chunk_tokens
    return -(-int(tokens * bytes_per_token) // MiB) / 1024
