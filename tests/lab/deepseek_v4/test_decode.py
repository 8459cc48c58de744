"""The decode benchmark through LLMEngine at toy dimensions on CPU: one row per batch x prompt
with timed decode steps of one token per request, prompts long enough that early requests decode
during the others' prefill, an out-of-memory step recorded without stopping the run, the
deadline, and the docs section written once between its markers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import EngineError
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.models.deepseek_v4.config import DeepseekV4Config
from engine.sampling_params import SamplingParams
from lab.bench.deepseek_v4.context import flash_config
from lab.bench.deepseek_v4.decode import HEADING, hf_dict, main, max_tokens_for

DOC = Path(__file__).resolve().parents[3] / "docs" / "deepseek_v4.md"
BEGIN, END = "<!-- bench_decode:begin -->", "<!-- bench_decode:end -->"


def _run(out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    rc = main(["run", "--tiny", "--device", "cpu", "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("decode") / "r.json"
    rc, _ = _run(out, "--prompts", "20,200")
    return rc, out


def test_no_pdl_switches_pdl_off_for_the_run(tmp_path, monkeypatch) -> None:
    import lab.bench.deepseek_v4.decode as dec

    seen = []

    def fake_run(args):  # what the run's launches would see
        seen.append(os.environ.get("BULKHEAD_PDL"))
        return {"rows": [], "stopped": None, "error": None}

    monkeypatch.setattr(dec, "run_decode", fake_run)
    monkeypatch.setattr(dec, "report_table", lambda result: "")
    monkeypatch.setenv("BULKHEAD_PDL", "1")
    rc, res = _run(tmp_path / "r.json", "--no-pdl")
    assert rc == 0 and seen == ["0"] and res["no_pdl"] is True and res["pdl"] is False
    assert os.environ["BULKHEAD_PDL"] == "1"  # put back
    rc, res = _run(tmp_path / "r.json")
    assert seen == ["0", "1"] and res["no_pdl"] is False
    rc, res = _run(tmp_path / "r.json", "--pdl", "trigger+prefetch")
    assert seen == ["0", "1", "trigger+prefetch"] and res["pdl_mode"] == 0  # (CPU: PDL off)
    assert os.environ["BULKHEAD_PDL"] == "1"
    with pytest.raises(ValueError, match="'soon'"):
        _run(tmp_path / "r.json", "--pdl", "trigger,soon")
    assert os.environ["BULKHEAD_PDL"] == "1" and seen == ["0", "1", "trigger+prefetch"]


def test_hf_dict_round_trips_the_flash_config() -> None:
    cfg = flash_config("SCHS", 8, 16384)
    d = hf_dict(cfg)
    assert DeepseekV4Config.from_hf_dict(d) == cfg
    assert DeepseekV4Config.coerce(ModelConfig.from_hf_dict(d)) == cfg
    assert cfg.compress_rope.rope_type == "yarn"  # the nested rope survives the trip


def test_run_rows(tiny_run: tuple[int, Path]) -> None:
    rc, out = tiny_run
    res = json.loads(out.read_text())
    assert rc == 0 and res["error"] is None and res["stopped"] is None
    assert (res["device"], res["indexer"], res["dtype"], res["max_batch"]) == ("cpu", "torch", "fp32", 2)
    assert (res["context"], res["chunk"], res["steps"]) == (256, 16, 3)
    assert res["warmup"]["activation_planned_bytes"] > 0 and res["warmup"]["workspace_capacity_bytes"] > 0
    assert res["warmup"]["activation_peak_bytes"] is None  # measured on CUDA only
    assert res["no_pdl"] is False and res["pdl"] is False  # no PDL on the CPU
    assert [(r["batch"], r["prompt"]) for r in res["rows"]] == [(1, 20), (1, 200), (2, 20), (2, 200)]
    for r in res["rows"]:
        assert r["error"] is None
        assert r["tokens"] == r["batch"] * 3 and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"])
        assert r["device_allocs_since_warmup"] is None and r["device_allocs_row"] is None  # CPU
        lo, hi = r["context_at_start"]
        assert lo >= r["prompt"] + 1 + 2  # first token + the warm steps before timing
        assert r["prefill_steps"] >= -(-r["batch"] * r["prompt"] // 16)
    # the first request decoded while the second prefilled, past steps + 8 output tokens: a
    # max_tokens of steps + 8 would have finished it before the timed steps
    lo, hi = res["rows"][3]["context_at_start"]
    assert hi - lo > 3 + 8
    assert max_tokens_for(2, 200, 16, 3, 2) > hi - 200


def test_out_of_memory_row_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OOM inside a scheduled decode step (after the scheduler planned it): that row records
    it, its requests are aborted, and the next row runs on the same engine."""
    real = ModelRunner.execute
    raised: list[str] = []

    def execute(self: ModelRunner, out: Any, params: Any, generators: Any,
                *rest: Any) -> dict[str, int]:
        ids = [c.request_id for c in out.chunks]
        if not raised and ids and all(i.startswith("b1-") and c.num_tokens == 1
                                      for i, c in zip(ids, out.chunks, strict=True)):
            raised.append(ids[0])
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore")
        return real(self, out, params, generators, *rest)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    rc, res = _run(tmp_path / "r.json")
    assert rc == 1 and raised == ["b1-p20-0"]
    assert [r["error"] for r in res["rows"]] == [
        "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB.", None]
    assert res["rows"][1]["tokens"] == 6 and res["rows"][1]["tokens_per_s"] > 0


def test_deadline_stops_cleanly(tmp_path: Path) -> None:
    rc, res = _run(tmp_path / "r.json", "--deadline", "0")
    assert rc == 0 and res["rows"] == []
    assert res["stopped"].startswith("deadline (0 s) before B=1 prompt=20")


def test_a_lane_list_measures_each_row_per_entry_on_one_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--lanes 2,1: the engine is built once (with 2 lanes), every row runs twice, and between
    the passes the model's backend takes 1 lane and the decode graphs are captured again."""
    import lab.bench.deepseek_v4.decode as dec
    from engine.llm_engine import LLMEngine

    builds: list[int] = []
    engines: list[LLMEngine] = []
    real_build = dec.build_engine

    def build(args: Any) -> Any:
        builds.append(args.lanes)
        engine, info = real_build(args)
        engines.append(engine)
        return engine, info

    seen: list[int] = []
    real = LLMEngine.recapture_graphs

    def recapture(self: LLMEngine, *a: Any) -> None:
        seen.append(self.runner.model.model.backend.lanes)
        real(self, *a)

    monkeypatch.setattr(dec, "build_engine", build)
    monkeypatch.setattr(LLMEngine, "recapture_graphs", recapture)
    rc, res = _run(tmp_path / "r.json", "--lanes", "2,1", "--batches", "1", "--prompts", "20,40")
    assert rc == 0 and res["error"] is None and res["lanes"] == [2, 1]
    assert builds == [2] and seen == [1]
    assert [(r["lanes"], r["prompt"]) for r in res["rows"]] == [(2, 20), (2, 40), (1, 20), (1, 40)]
    assert all(r["error"] is None and r["tokens"] == 3 for r in res["rows"])
    table = dec.report_table(res)
    assert "| lanes | batch |" in table and "| 1 | 1 | 40 |" in table
    with pytest.raises(SystemExit, match="each entry must be 1 or 2"):
        _run(tmp_path / "r.json", "--lanes", "2,3")
    # the warm-up's re-run writes over free blocks: not while a request holds some
    engine = engines[0]
    engine.add_request("busy", list(range(1, 30)), SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(EngineError, match="still running"):
        engine.recapture_graphs()
    engine.abort("busy")
    while engine.has_unfinished():
        engine.step()
    engine.recapture_graphs()


def test_forgetting_cached_prefixes_needs_every_block_free() -> None:
    """What recapture_graphs asks of the block manager: an idle engine forgets its cached
    prefixes (their blocks are about to be written over); blocks in use refuse it."""
    from engine.block_manager import BlockManager

    tokens = list(range(8))
    bm = BlockManager(8, 4)
    allocated = bm.allocate(tokens, 8, 8)
    assert allocated is not None
    blocks = allocated[0]
    bm.register_full_blocks(blocks, [], lambda a, b: tokens[a:b], 8)
    with pytest.raises(RuntimeError, match="2 block"):
        bm.forget_cached_prefixes()
    bm.free(blocks)
    assert bm.match_prefix(tokens) == blocks  # freed, still cached
    bm.forget_cached_prefixes()
    assert bm.match_prefix(tokens) == [] and bm.num_free_blocks == 7


def test_report_writes_the_section_once(tiny_run: tuple[int, Path], tmp_path: Path) -> None:
    _, out = tiny_run
    docs = tmp_path / "docs"
    docs.mkdir()
    md = docs / "deepseek_v4.md"
    shutil.copy(DOC, md)
    before = md.read_text()
    assert before.count(BEGIN) == before.count(END) == before.count(HEADING) == 1
    for _ in range(2):
        assert main(["report", str(out), "--docs", str(docs)]) == 0
        text = md.read_text()
        assert text.count(BEGIN) == text.count(END) == text.count(HEADING) == 1
        section = text[text.index(BEGIN) : text.index(END)]
        assert "Not measured yet" not in section
        assert "| 2 | 200 |" in section and "| 1 | 20 |" in section
        # everything outside the markers is untouched
        assert text[: text.index(BEGIN)] == before[: before.index(BEGIN)]
        assert text[text.index(END) :] == before[before.index(END) :]
    md.write_text("# V4\n")  # a doc without the section gets it appended under its heading
    assert main(["report", str(out), "--docs", str(docs)]) == 0
    text = md.read_text()
    assert text.startswith("# V4\n") and text.count(HEADING) == 1 and text.index(HEADING) < text.index(BEGIN)


def test_quantized_weights_run(tmp_path: Path) -> None:
    """--weights fp8-mxfp4: the model holds FP8 projections and MXFP4 experts made on the device
    (through from_state_dict, as a checkpoint would be), and decodes."""
    from engine.models.deepseek_v4.model import DeepseekV4Model
    from engine.models.deepseek_v4.weights.quant_modules import Fp8Linear, Mxfp4Experts
    from lab.bench.deepseek_v4.quantized_weights import synthetic_quantized_state_dict

    rc, res = _run(tmp_path / "q.json", "--weights", "fp8-mxfp4", "--prompts", "20", "--batches", "1")
    assert rc == 0 and res["weights"] == "fp8-mxfp4" and res["rows"][0]["error"] is None
    assert res["resident_weight_bytes"] == res["weights_bytes"]
    cfg = flash_config("SCH", 8, 256, tiny=True)
    cfg = dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32)
    model = DeepseekV4Model.from_state_dict(cfg, synthetic_quantized_state_dict(cfg, "cpu", torch.float32),
                                            torch.float32)
    assert isinstance(model.model.layers[1].self_attn.q_b_proj, Fp8Linear)
    assert isinstance(model.model.layers[1].mlp.experts, Mxfp4Experts)
    assert isinstance(model.model.layers[1].self_attn.compressor.kv_proj, torch.nn.Linear)


def test_config_estimate_equals_the_quantized_weights() -> None:
    """bulkhead plan's weight estimate (config only) = the bytes of the quantized tensors the
    bench makes (fp32 model, so every float tensor is 4 B either way); dequantized is larger."""
    from engine.models.deepseek_v4.weights.quant_weights import resident_weight_bytes
    from engine.models.deepseek_v4.weights.weight_bytes import deepseek_v4_weight_bytes
    from lab.bench.deepseek_v4.quantized_weights import synthetic_quantized_state_dict

    cfg = dataclasses.replace(flash_config("SCH", 8, 256, tiny=True), hidden_size=32, moe_intermediate_size=32)
    sd = synthetic_quantized_state_dict(cfg, "cpu", torch.float32)
    est = deepseek_v4_weight_bytes(cfg, torch.float32, True, True, "checkpoint")
    assert est == resident_weight_bytes(sd, torch.float32, "checkpoint")
    assert deepseek_v4_weight_bytes(cfg, torch.float32, True, True, "dequantize") == \
        resident_weight_bytes(sd, torch.float32, "dequantize") > est


def test_decode_flag_reaches_the_engines_model(tmp_path: Path) -> None:
    """``--decode`` picks the model's decode loop for the build only (the family's constructor
    is restored afterwards), and the result names the path that ran."""
    from engine.models.deepseek_v4.family import DeepseekV4Family

    init = DeepseekV4Family.__init__
    rc, res = _run(tmp_path / "u.json", "--decode", "unfused", "--batches", "1", "--steps", "2")
    assert rc == 0 and res["decode_path"] == "unfused"
    assert DeepseekV4Family.__init__ is init
    rc, res = _run(tmp_path / "a.json", "--batches", "1", "--steps", "2")
    assert rc == 0 and res["decode_path"] == "unfused"  # CPU: 'auto' resolves to the torch loop
