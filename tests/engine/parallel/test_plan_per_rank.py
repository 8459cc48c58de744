"""`bulkhead plan --tensor-parallel-size N`: one rank's plan. Dense: heads, KV heads and MLP
divided, embedding and head whole. DeepSeek-V4-Flash (FP8 / MXFP4 as shipped): query heads and
routed experts divided, the single KV head and the indexer whole on every rank, so KV and the
indexer's scratch do not shrink; communication buffers counted. A size that does not divide the
model is refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.plan_cli import main

DATA = Path(__file__).resolve().parents[2] / "data"
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
         "scale_fmt": "ue8m0", "activation_scheme": "dynamic", "expert_dtype": "fp4"}


def _plan(capsys, model: Path, *args: str) -> dict:
    main(["--model", str(model), "--json", *args])
    return json.loads(capsys.readouterr().out)


def _terms(plan: dict) -> dict[str, int]:
    return {t["name"]: t["bytes"] for t in plan["terms"]}


def test_dense_rank_holds_its_share(capsys) -> None:
    model = DATA / "qwen3-8b-config.json"
    args = ("--max-context", "32768", "--chunk-tokens", "2048", "--max-batch", "4")
    one = _terms(_plan(capsys, model, *args))
    two = _terms(_plan(capsys, model, *args, "--tensor-parallel-size", "2"))
    assert two["kv_cache"] * 2 == one["kv_cache"]  # 8 KV heads: 4 a rank
    embed_and_head = 2 * 151936 * 4096 * 2
    assert two["weights"] - embed_and_head == pytest.approx((one["weights"] - embed_and_head) / 2,
                                                            rel=1e-3)
    assert two["tp.allreduce_staging"] == 2048 * 4096 * 2
    assert two["tp.nccl_buffers"] > 0 and "tp.nccl_buffers" not in one


def test_v4_flash_on_two_96_gb_cards(capsys) -> None:
    model = DATA / "deepseek-v4-flash-config.json"
    cfg = json.loads(model.read_text())  # as shipped: FP8 projections, MXFP4 experts
    assert {**cfg["quantization_config"], "expert_dtype": cfg["expert_dtype"]} == QUANT
    args = ("--max-context", "262144", "--chunk-tokens", "1024", "--max-batch", "4",
            "--block-size", "256", "--kv-dtype", "fp8", "--num-blocks", "2132",
            "--device-memory-gib", "94.97", "--memory-utilization", "0.975")
    one = _terms(_plan(capsys, model, *args))
    plan = _plan(capsys, model, *args, "--tensor-parallel-size", "2")
    two = _terms(plan)
    # half the routed experts and query heads a rank; embedding, head, KV head, indexer whole
    assert 0.45 * one["weights"] < two["weights"] < 0.55 * one["weights"]
    assert two["kv_cache"] == one["kv_cache"]
    assert plan["kv_tokens"] == 2131 * 256
    assert two["ws.indexer"] == one["ws.indexer"]  # the indexer's scratch is not divided
    assert two["activations"] < one["activations"]
    # the operator's 7.94 GiB of KV a rank holds 7,347 blocks of our pool (vLLM: 1,196,643 tokens)
    operator = [*args[:-6], "--num-blocks", "7347", *args[-4:]]
    main(["--model", str(model), *operator, "--tensor-parallel-size", "2", "--weights-gib", "81.11"])
    out = capsys.readouterr().out
    assert "per rank (each of 2): weights 81.11 GiB, KV 7.94 GiB = 1,880,576 tokens" in out


def test_a_size_that_does_not_divide_is_refused(capsys, tmp_path) -> None:
    assert main(["--model", str(DATA / "deepseek-v4-flash-config.json"), "--max-context", "4096",
                 "--tensor-parallel-size", "3"]) == 2
    assert "num_attention_heads=64" in capsys.readouterr().err
    assert main(["--model", str(DATA / "qwen3-8b-config.json"), "--max-context", "4096",
                 "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size=3 does not split" in capsys.readouterr().err
