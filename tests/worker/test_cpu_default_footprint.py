"""`bulkhead up` with no arguments on the CPU: what its two workers plan (the memory plans and
LMCache's pools) stays within the share of 2 GB docs/serving.md gives it, and the CUDA defaults are
the ones they were. The plan is deterministic: nothing is loaded, timed or measured here (the
measured RSS, with its command, is in docs/serving.md and docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from common.settings import load_worker_settings
from engine.checkpoint import load_model_config
from engine.config import CPU_AUTO_KV_TOKENS
from engine.config_resolve import CPU_AUTO_CONTEXT, resolve_engine_config
from engine.memory_planner import make_plan
from engine.models import family_class
from tests.helpers.default_model import default_model_or_skip
from worker.kv_store_config import KVStoreConfig, auto_chunk_tokens
from worker.lmcache_engine import lmcache_pool_gb
from worker.worker_config import StoreSettings, WorkerConfig, staging_gb

MiB = 1 << 20
# The workers' plans and pools of a default CPU `up`, SmolLM2-135M: 913 MiB when written; the
# processes' own Python, torch and LMCache (about 1.1 GiB of RSS for all of them) make the rest
# of the 2 GB (docs/serving.md, "What it holds on a CPU").
PLANNED_BUDGET_MIB = 960
STORE = "redis://127.0.0.1:6379"  # `up` starts a redis-server: the decode worker only reads it


def _planned_mib(role: str, device: str) -> tuple[int, WorkerConfig]:
    settings = load_worker_settings(role, ["--device", device], env={"BULKHEAD_KV_STORE_URL":
                                                                     STORE})
    config = WorkerConfig.from_settings(settings)
    model = load_model_config(config.settings.model)
    ec = resolve_engine_config(config.engine, model)
    plan = make_plan(model, ec, 64 << 30)
    layout = family_class(model).kv_layout(model, ec)
    chunk = auto_chunk_tokens(layout.block_size, layout.bytes_per_block)
    store = KVStoreConfig(url=STORE, model_name="m", engine_layout=layout.fingerprint,
                          block_size=layout.block_size, bytes_per_block=layout.bytes_per_block,
                          chunk_size=chunk,
                          staging_gb=staging_gb(config.store, ec, layout.bytes_per_token, chunk))
    pool = lmcache_pool_gb(store, writes=role == "prefill")
    return (plan.total_bytes + int(pool * (1 << 30))) // MiB, config


def test_default_cpu_up_plans_within_its_share_of_2_gb() -> None:
    default_model_or_skip()
    prefill, config = _planned_mib("prefill", "cpu")
    decode, _ = _planned_mib("decode", "cpu")
    assert prefill + decode <= PLANNED_BUDGET_MIB, (prefill, decode)
    ec = config.engine
    assert ec.dtype == "bfloat16" and ec.kv_tokens == CPU_AUTO_KV_TOKENS == CPU_AUTO_CONTEXT
    assert ec.kv_import_slice_bytes == 16 * MiB


def test_cuda_defaults_are_unchanged() -> None:
    """On CUDA: bfloat16 (as auto was), every running sequence's KV, a 64 MiB import slice
    and a 0.5 GB staging."""
    default_model_or_skip()
    settings = load_worker_settings("prefill", ["--device", "cuda"],
                                    env={"BULKHEAD_KV_STORE_URL": STORE})
    ec = WorkerConfig.from_settings(settings).engine
    assert ec.dtype == "bfloat16" and ec.kv_tokens == 0
    assert ec.kv_import_slice_bytes == 64 * MiB
    assert staging_gb(StoreSettings.from_settings(settings), ec, 23040.0, 256) == 0.5


@pytest.mark.parametrize("flags, tokens", [(["--kv-tokens", "100"], 4096),  # >= one sequence
                                           (["--kv-tokens", "10000"], 10000),
                                           (["--kv-tokens", "99999"], 8 * 4096),  # <= every one
                                           (["--num-blocks", "300"], 299 * 16)])
def test_kv_tokens_sizes_the_extent_between_one_and_every_sequence(flags: list[str],
                                                                   tokens: int) -> None:
    default_model_or_skip()
    settings = load_worker_settings("decode", ["--device", "cpu", *flags], env={})
    config = WorkerConfig.from_settings(settings)
    ec = resolve_engine_config(config.engine, load_model_config(config.settings.model))
    assert (ec.resolved_num_blocks - 1) * ec.block_size == -(-tokens // 16) * 16
