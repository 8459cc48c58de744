"""A worker's settings split by who uses them: the engine's frozen ``EngineConfig``, the KV
store's ``StoreSettings`` and the process's own (network, registry, auth, logging).

Built once at start-up from ``WorkerSettings`` (common/settings.py, torch-free so that
``--help`` and the launcher stay light); from here on each part is handed only to its user.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.settings import StoreSettings, WorkerSettings
from engine.config import EngineConfig, KernelChoices


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
            warmup_record_dir=s.warmup_record_dir,
            tensor_parallel_size=s.tensor_parallel_size,
            kv_import_slice_bytes=max(1, int(s.kv_import_slice_mb * (1 << 20))),
            kv_dtype=s.kv_cache_dtype, load_format=s.load_format, memory_share=s.memory_share,
            kernels=KernelChoices(indexer=s.indexer_backend, attention=s.sparse_attention_backend,
                                  gemm=s.quant_gemm_backend, mhc=s.mhc_backend,
                                  decode=s.decode_loop, lanes=s.decode_lanes))
        return cls(settings, engine, settings.store)
