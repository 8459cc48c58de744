"""One configuration path: a worker's EngineConfig comes from its settings through one function
(no hand copy), every engine field is reached by a setting or named engine-only, every setting
that reaches the engine changes it, and `bulkhead plan` reads the same flags, file and defaults
as the workers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.settings import WorkerSettings, load_worker_settings
from engine import plan_cli
from engine.config import (
    _CONVERTED,
    ENGINE_ONLY,
    EngineConfig,
    engine_config_from_settings,
    engine_settings_names,
)

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL = str(DATA / "qwen3-8b-config.json")

# A valid value other than the default, per setting that reaches the engine.
OTHER = {"model": "elsewhere", "device": "cpu", "dtype": "float16",
         "weight_format": "dequantize", "max_context": "8192", "chunk_tokens": 1024,
         "max_batch": 3, "block_size": 32, "num_blocks": 4000, "attn_tile_tokens": 512,
         "kv_cache_dtype": "fp8", "max_queue": 7, "enable_prefix_cache": False,
         "memory_utilization": 0.5, "memory_share": 0.5, "device_memory_gb": 12.0,
         "strict_allocations": True, "cuda_graphs": False, "seed": 9,
         "tensor_parallel_size": 2, "load_format": "dummy", "indexer_backend": "torch",
         "sparse_attention_backend": "torch", "quant_gemm_backend": "torch",
         "mhc_backend": "torch", "decode_loop": "unfused", "decode_lanes": 2,
         "share_weights": "", "share_weights_timeout_s": 5.0, "kv_import_slice_mb": 8.0,
         "kv_tokens": 10000, "warmup_record_dir": "/tmp/warmup-records",
         "speculative_method": "ngram", "num_speculative_tokens": 5}


def test_every_engine_field_is_a_setting_a_conversion_or_engine_only() -> None:
    settings = {f.name for f in dataclasses.fields(WorkerSettings)}
    for f in dataclasses.fields(EngineConfig):
        assert f.name in settings or f.name in _CONVERTED or f.name in ENGINE_ONLY, (
            f"EngineConfig.{f.name} is reached by no worker setting: add the setting, a "
            "conversion in engine/config.py, or name it in ENGINE_ONLY")


@pytest.mark.parametrize("name", sorted(engine_settings_names(WorkerSettings)))
def test_each_setting_that_reaches_the_engine_changes_it(name: str) -> None:
    assert name in OTHER, f"give {name} a non-default value in OTHER"
    base = WorkerSettings(model="m")
    if name == "share_weights":  # '' is the default; any path turns it on
        changed = dataclasses.replace(base, share_weights="/tmp/handle")
    else:
        changed = dataclasses.replace(base, **{name: OTHER[name]})
    assert engine_config_from_settings(changed) != engine_config_from_settings(base), name


def test_the_plan_reads_the_workers_flags_file_and_environment(tmp_path, monkeypatch) -> None:
    config = tmp_path / "settings.yaml"
    config.write_text("worker:\n  chunk_tokens: 2048\n  kv_cache_dtype: fp8\n"
                      "decode:\n  max_batch: 5\nprefill:\n  max_batch: 2\n"
                      "router:\n  port: 9000\n")
    monkeypatch.setenv("BULKHEAD_MEMORY_SHARE", "0.5")
    flags = ["--model", MODEL, "--config", str(config), "--max-context", "32768",
             "--device", "cuda"]
    worker = engine_config_from_settings(load_worker_settings("decode", flags))
    settings, _ = plan_cli._settings(flags)
    assert engine_config_from_settings(settings) == worker
    assert (worker.chunk_tokens, worker.kv_dtype, worker.max_batch, worker.memory_share,
            worker.max_context) == (2048, "fp8", 5, 0.5, 32768)
    prefill, _ = plan_cli._settings([*flags, "--role", "prefill"])
    assert prefill.max_batch == 2


def test_the_plan_prints_the_workers_defaults(capsys) -> None:
    defaults = WorkerSettings()
    assert plan_cli.main(["--model", MODEL, "--max-context", "4096"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert (f"chunk {defaults.chunk_tokens}, max_batch {defaults.max_batch}, block_size 16"
            in first), first


def test_a_bad_plan_flag_names_the_setting(capsys) -> None:
    assert plan_cli.main(["--model", MODEL, "--kv-cache-dtype", "int4"]) == 2
    assert "kv_cache_dtype: 'int4' is not one of auto, fp8" in capsys.readouterr().err
    assert plan_cli.main(["--max-context", "4096"]) == 2
    assert "model: give the config.json" in capsys.readouterr().err
