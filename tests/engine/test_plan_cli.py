"""`bulkhead plan`: the model named by what was given and the checkpoint's own architecture (not
the folder a config file sits in), and the V4-Flash config in tests/data, which carries its
shipped quantization_config, fits a rank of the operator's 2 x 94.97 GiB as docs/memory.md says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engine.plan_cli import main

DATA = Path(__file__).resolve().parents[1] / "data"
SMALL = ("--max-context", "4096", "--chunk-tokens", "512", "--max-batch", "2")


def test_plan_names_the_model_not_its_folder(capsys, tmp_path) -> None:
    assert main(["--model", str(DATA / "qwen3-8b-config.json"), *SMALL]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("model qwen3-8b-config.json: Qwen3ForCausalLM (qwen3), "), first
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    cfg = json.loads((DATA / "qwen3-8b-config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "Qwen/Qwen3-8B"}))
    assert main(["--model", str(folder), *SMALL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "Qwen3-8B: Qwen/Qwen3-8B (qwen3)"
    shutil.copy(DATA / "qwen3-8b-config.json", folder / "config.json")
    assert main(["--model", str(folder / "config.json"), *SMALL]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("model Qwen3-8B/config.json: Qwen3ForCausalLM (qwen3), "), first


def test_v4_flash_config_plans_its_stored_weights_and_fits(capsys) -> None:
    cmd = ["--model", str(DATA / "deepseek-v4-flash-config.json"), "--max-context", "262144",
           "--chunk-tokens", "4096", "--max-batch", "4", "--block-size", "256",
           "--attn-tile-tokens", "256", "--kv-dtype", "fp8", "--num-blocks", "7347",
           "--tensor-parallel-size", "2", "--device-memory-gib", "94.97",
           "--memory-utilization", "0.975"]  # docs/memory.md's check by hand
    assert main(cmd) == 0
    out = capsys.readouterr().out
    assert "FP8 projections 1 B + fp32 per 128x128, MXFP4 experts 0.5 B + 1 B per 32" in out
    assert "per rank (each of 2): weights 74.71 GiB, KV 7.94 GiB = 1,880,576 tokens" in out
