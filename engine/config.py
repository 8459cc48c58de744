"""The engine's start-up configuration: one frozen dataclass built at the entry point.

Everything that decides memory is here and fixed for the life of the process: the longest context,
the largest chunk, the batch, the block size and the KV extent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import PlanError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The kernel choices a family may offer (its backend module explains each one);
# families without the operation ignore its choice.
INDEXERS = ("auto", "torch", "kernels", "kernels_ref", "naive")
SPARSE_ATTENTIONS = ("auto", "torch", "kernels", "kernels_ref")
GEMMS = ("auto", "torch", "kernels")
MHCS = ("auto", "torch", "kernels")
DECODE_LOOPS = ("auto", "fused", "unfused")
LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE_METHODS = ("none", "ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16  # draft tokens per sequence and step, the most a plan may size for


@dataclass(frozen=True)
class KernelChoices:
    """Which implementation runs each replaceable operation of a model family: the sparse
    indexer's top-k, the sparse attention core, the quantized GEMMs, the hyper-connection (mHC)
    passes, the decode step's loop and its lanes (streams). "auto" lets the family choose by
    device. Worker settings ``indexer_backend`` ... ``decode_lanes`` fill it; a benchmark sets
    it the same way, never by patching a class."""

    indexer: str = "auto"
    attention: str = "auto"
    gemm: str = "auto"
    mhc: str = "auto"
    decode: str = "auto"
    lanes: int = 1

    def __post_init__(self) -> None:
        for name, allowed in (("indexer", INDEXERS), ("attention", SPARSE_ATTENTIONS),
                              ("gemm", GEMMS), ("mhc", MHCS), ("decode", DECODE_LOOPS)):
            if getattr(self, name) not in allowed:
                raise PlanError(f"kernels.{name}={getattr(self, name)!r} is not one of "
                                f"{', '.join(allowed)}")
        if self.lanes not in (1, 2):
            raise PlanError(f"kernels.lanes={self.lanes!r} is not 1 or 2")


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF checkpoint folder, config.json, or .gguf file
    device: str = "auto"  # "auto" -> cuda if available else cpu
    dtype: str = "auto"  # "auto" -> float32 on CPU, bfloat16 on CUDA
    # Quantized checkpoints (FP8 / MXFP4 payloads with scales): "checkpoint" keeps them as stored,
    # "dequantize" is the explicit way to a ``dtype`` model. Never upcast silently.
    weight_format: str = "checkpoint"
    # longest prompt + output of one sequence; 0 = auto (engine/config_resolve.py): on CUDA the
    # longest that fits the memory budget up to the model's own limit, elsewhere
    # min(CPU_AUTO_CONTEXT, the model's limit)
    max_context: int = 0
    chunk_tokens: int = 512  # most tokens computed in one step (the prefill chunk)
    max_batch: int = 8  # most sequences running at once
    block_size: int = 0  # KV block size in tokens; 0 = the model family's default
    num_blocks: int | None = None  # KV extent; None -> kv_tokens' worth (+ the null block)
    # tokens the extent holds when num_blocks is None, all sequences together, at least one
    # whole max_context sequence; 0 -> max_batch x max_context (every running sequence can reach
    # max_context). A worker's settings choose a smaller one on the CPU (CPU_AUTO_KV_TOKENS)
    kv_tokens: int = 0
    # "auto": KV stored in the model dtype; "fp8": stored entries in FP8 e4m3 (each family picks
    # its scaling: a per-row fp32 scale, or vLLM's uncalibrated scale 1.0 in kernels/kv_quant.py)
    kv_dtype: str = "auto"
    attn_tile_tokens: int = 0  # keys per attention tile (PyTorch path); 0 = 256 in whole blocks
    attention_backend: str = "auto"  # "auto" (triton on CUDA, else torch) | "torch" | "triton"
    max_queue: int = 256  # waiting requests beyond which add_request raises QueueFull
    enable_prefix_cache: bool = True
    device_memory_bytes: int | None = None  # None -> the device's total memory
    memory_utilization: float = 0.92  # share of device memory the plan may take
    # CUDA: a device allocation after warm-up raises (strict) or is logged and counted. Serving
    # defaults to counting: the step already ran within the budget's headroom, and failing every
    # in-flight request over it would be worse; tests and benchmarks run strict.
    strict_allocations: bool = False
    cuda_graphs: bool = True  # CUDA + Triton attention: capture decode steps as graphs
    seed: int = 0
    # Ranks one worker spans (engine/parallel/): one process each, rank 0 schedules and samples.
    # 1 = the single-process engine, untouched.
    tensor_parallel_size: int = 1
    # One-box mode: a handle file path shared by the engines of one GPU. The first to start loads
    # the weights and exports them (CUDA IPC); the others map that one copy (weight_share.py).
    share_weights: str = ""
    share_weights_timeout_s: float = 600.0  # how long a mapping engine waits for the export
    # CPU: a folder where a warm-up that passed is recorded; an engine with the same model,
    # config, torch and code skips the warm-up's steps (engine/warmup_record.py). '' = off.
    warmup_record_dir: str = ""
    # Most bytes of imported KV copied into blocks per engine step, all imports together (whole
    # blocks, at least one): the stall an import adds to each running decode's step. 64 MiB is
    # ~1.3 ms over PCIe Gen5 from page-locked memory and ~11 ms from pageable (~6 GB/s
    # measured on the H200 host); a 128k-token Llama-3-8B prompt (16 GiB) takes 256 steps.
    kv_import_slice_bytes: int = 64 << 20
    kernels: KernelChoices = field(default_factory=KernelChoices)
    # "auto": the checkpoint's weights; "dummy": random weights of the checkpoint's shapes and
    # storage formats, made on the device from config.json alone (deterministic by ``seed``)
    load_format: str = "auto"
    # Share of (budget - the weights) this engine's own terms may take: the roles of one card
    # (one-box mode) split what the one copy of the weights leaves. 1 = the whole budget.
    memory_share: float = 1.0
    # Speculative decoding (engine/spec_decode.py): "none" | "ngram" (prompt lookup) | "mtp"
    # (a checkpoint's own multi-token-prediction layers, where its family has them); with a
    # method, every decode step may verify up to ``num_speculative_tokens`` draft tokens per
    # sequence (a request may ask for fewer), and the plan sizes the verify rows for them
    speculative_method: str = "none"
    num_speculative_tokens: int = 3

    def __post_init__(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise PlanError(f"speculative_method must be one of "
                            f"{', '.join(SPECULATIVE_METHODS)}; got {self.speculative_method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise PlanError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                            f"got {self.num_speculative_tokens}")
        if self.dtype not in ("auto", *_DTYPES):
            raise PlanError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.weight_format not in ("checkpoint", "dequantize"):
            raise PlanError(f"weight_format must be checkpoint or dequantize; got {self.weight_format!r}")
        for name in ("chunk_tokens", "max_batch", "max_queue", "tensor_parallel_size",
                     "kv_import_slice_bytes"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_tokens < 0:
            raise PlanError(f"kv_tokens must be >= 0 (0 = max_batch x max_context), got "
                            f"{self.kv_tokens}")
        for name in ("max_context", "block_size", "attn_tile_tokens"):  # 0: resolved later
            if getattr(self, name) < 0:
                raise PlanError(f"{name} must be >= 0 (0 = from the model), got "
                                f"{getattr(self, name)}")
        if self.max_context == 1:
            raise PlanError("max_context must be >= 2")
        if self.block_size and self.attn_tile_tokens and self.attn_tile_tokens % self.block_size:
            raise PlanError(f"attn_tile_tokens={self.attn_tile_tokens} must be a multiple of "
                            f"block_size={self.block_size}; "
                            f"{-(-self.attn_tile_tokens // self.block_size) * self.block_size} "
                            "would do")
        if self.load_format not in LOAD_FORMATS:
            raise PlanError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got "
                            f"{self.load_format!r}")
        if not 0 < self.memory_share <= 1:
            raise PlanError(f"memory_share must be in (0, 1], got {self.memory_share}")
        if self.kv_dtype not in ("auto", "fp8"):
            raise PlanError(f"kv_dtype must be auto or fp8; got {self.kv_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise PlanError(f"attention_backend must be auto, torch or triton; got "
                            f"{self.attention_backend!r}")
        if self.share_weights and self.tensor_parallel_size > 1:
            raise PlanError("share_weights and tensor_parallel_size > 1 do not combine: each rank "
                            "holds its own share of the weights")
        if self.share_weights_timeout_s <= 0:
            raise PlanError(f"share_weights_timeout_s must be > 0, got "
                            f"{self.share_weights_timeout_s}")
        if not 0.1 <= self.memory_utilization <= 1.0:
            raise PlanError(f"memory_utilization must be in [0.1, 1], got {self.memory_utilization}")
        if (self.max_context and self.block_size and self.num_blocks is not None
                and self.num_blocks < self.blocks_per_seq + 1):
            raise PlanError(
                f"num_blocks={self.num_blocks} cannot hold one sequence of max_context="
                f"{self.max_context} ({self.blocks_per_seq} blocks of {self.block_size} + the null "
                f"block); raise num_blocks or lower max_context")

    @property
    def is_resolved(self) -> bool:
        """Whether the model-dependent sizes (0 = from the model) are fixed yet
        (engine/config_resolve.py)."""
        return bool(self.max_context and self.block_size and self.attn_tile_tokens)

    @property
    def blocks_per_seq(self) -> int:
        assert self.max_context and self.block_size, "sizes used before resolve_engine_config"
        return -(-self.max_context // self.block_size)

    @property
    def resolved_num_blocks(self) -> int:
        if self.num_blocks:
            return self.num_blocks
        every = self.max_batch * self.blocks_per_seq  # every running sequence at max_context
        if not self.kv_tokens:
            return every + 1
        return min(every, max(self.blocks_per_seq, -(-self.kv_tokens // self.block_size))) + 1

    @property
    def spec_tokens(self) -> int:
        """Draft tokens a sequence may verify per step (0: speculation off)."""
        return 0 if self.speculative_method == "none" else self.num_speculative_tokens

    @property
    def verify_rows(self) -> int:
        """The most logits rows one step samples: every running sequence's last token and its
        drafts (max_batch x (k + 1)), never more than the step's tokens."""
        k = self.spec_tokens
        return self.max_batch if k == 0 else min(self.max_batch * (k + 1),
                                                 max(self.chunk_tokens, self.max_batch))

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def use_triton_attention(self) -> bool:
        if self.attention_backend == "auto":
            return self.torch_device.type == "cuda"
        return self.attention_backend == "triton"

    @property
    def use_cuda_graphs(self) -> bool:
        # Several ranks on CUDA talk over NCCL, whose all-reduce a graph captures; every rank
        # captures the same sizes in the same order (engine/parallel/follower.py).
        return (self.cuda_graphs and self.torch_device.type == "cuda"
                and self.use_triton_attention)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


# ------------------------------------------------------------ from the worker settings
# How a worker's settings (common/settings.py, the one loader) become its EngineConfig. A field
# of EngineConfig that has a worker setting of the same name takes it as it is; the few whose
# name or unit differ are converted here; the rest are engine-only (never a setting) and keep
# their defaults. tests/worker/test_engine_config_from_settings.py fails on a field that falls
# through none of these.
GiB_BYTES = 1 << 30
IMPORT_SLICE_MB = {"cuda": 64.0, "cpu": 16.0}  # kv_import_slice_mb 0
# kv_tokens 0 on the CPU: one sequence of engine/config_resolve.py's CPU_AUTO_CONTEXT (4096),
# not max_batch of them, since there the KV is the laptop's own RAM; the running sequences
# share it (at least one max_context sequence whatever max_context is)
CPU_AUTO_KV_TOKENS = 4096
_CONVERTED = {
    "max_context": lambda s, cpu: s.max_context_tokens,  # "auto" -> 0 (engine/config_resolve.py)
    "num_blocks": lambda s, cpu: s.num_blocks or None,  # 0 = kv_tokens' worth
    "kv_dtype": lambda s, cpu: s.kv_cache_dtype,  # vLLM's flag name
    "device_memory_bytes": lambda s, cpu: int(s.device_memory_gb * GiB_BYTES) or None,
    # the settings whose 0 means "by device": a server's sizes on CUDA, a laptop's on the CPU
    "kv_import_slice_bytes": lambda s, cpu: max(1, int(
        (s.kv_import_slice_mb or IMPORT_SLICE_MB["cpu" if cpu else "cuda"]) * (1 << 20))),
    "kv_tokens": lambda s, cpu: s.kv_tokens or (CPU_AUTO_KV_TOKENS if cpu else 0),
    "kernels": lambda s, cpu: KernelChoices(
        indexer=s.indexer_backend, attention=s.sparse_attention_backend,
        gemm=s.quant_gemm_backend, mhc=s.mhc_backend, decode=s.decode_loop,
        lanes=s.decode_lanes),
}
# Engine fields that no worker setting reaches (tests and benchmarks set them in code).
ENGINE_ONLY = frozenset({"attention_backend"})
# The worker settings the conversions above read (for `bulkhead plan`'s flags).
CONVERTED_FROM = frozenset({"max_context", "num_blocks", "kv_cache_dtype", "device_memory_gb",
                            "kv_import_slice_mb", "indexer_backend", "sparse_attention_backend",
                            "quant_gemm_backend", "mhc_backend", "decode_loop", "decode_lanes"})


def engine_settings_names(settings_cls: type) -> frozenset[str]:
    """The worker settings that reach the EngineConfig."""
    from dataclasses import fields

    own = {f.name for f in fields(settings_cls)}
    same = {f.name for f in fields(EngineConfig)} & own
    return frozenset(same | (CONVERTED_FROM & own))


def engine_config_from_settings(s) -> EngineConfig:  # noqa: ANN001 - common.settings.WorkerSettings
    """The EngineConfig of a worker with settings ``s`` (its ``model`` already resolved)."""
    from dataclasses import fields

    cpu = EngineConfig(model=s.model, device=s.device).torch_device.type == "cpu"
    values = {}
    for f in fields(EngineConfig):
        if f.name in _CONVERTED:
            values[f.name] = _CONVERTED[f.name](s, cpu)
        elif f.name in ENGINE_ONLY:
            continue
        else:
            values[f.name] = getattr(s, f.name)  # AttributeError: a field no setting reaches
    return EngineConfig(**values)
