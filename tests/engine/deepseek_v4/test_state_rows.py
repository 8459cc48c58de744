"""DeepSeek-V4 state as per-token rows (engine/models/deepseek_v4/state_rows.py): rows recorded
while a slot is prefilled in awkward chunks rebuild, for any prefix m (not aligned to compress
rates, windows or store chunks), exactly the state a live prefill of m tokens holds (bit-exact),
and a slot continued from imported rows computes bit-identical hidden states."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4 import DeepseekV4CacheState, DeepseekV4Config, DeepseekV4Model
from engine.models.deepseek_v4.state_rows import DeepseekV4StateRows, StateRowLayout
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS, build_hf_v4

PROMPT = 45
CONTEXT = 64


def _setup(name: str, dtype: torch.dtype = torch.float32) -> tuple[DeepseekV4Config, DeepseekV4Model]:
    model, raw = build_hf_v4(name)
    cfg = DeepseekV4Config.from_hf_dict(raw)
    return cfg, DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=dtype)


def _run(ours: DeepseekV4Model, cache: DeepseekV4CacheState, ids: torch.Tensor, slot: int,
         chunks: list[int]) -> torch.Tensor:
    """Feed ``ids`` into ``slot`` (continuing it) in chunks of the given sizes; hidden [n, h]."""
    out, s = [], 0
    sizes = iter(chunks * (ids.numel() + 1))
    while s < ids.numel():
        e = min(ids.numel(), s + next(sizes))
        start = cache.num_tokens[slot]
        out.append(ours(ids[s:e], torch.arange(start, start + e - s), [0, e - s], [slot], cache))
        s = e
    return torch.cat(out)


def _meaningful_state(cache: DeepseekV4CacheState, slot: int) -> dict[str, torch.Tensor]:
    """The parts of a slot's state that later steps read (stale bytes past them are never read)."""
    n, win = cache.num_tokens[slot], cache.cfg.sliding_window
    ring_pos = torch.arange(max(0, n - win), n) % win
    out: dict[str, torch.Tensor] = {}
    for i, lc in enumerate(cache.layers):
        out[f"{i}.window"] = lc.window[slot, ring_pos]
        for tag, st in (("compressor", lc.compressor), ("indexer", lc.indexer)):
            if st is None:
                continue
            e, o = n // st.rate, n % st.rate
            out[f"{i}.{tag}.entries"] = st.entries[slot, :e]
            out[f"{i}.{tag}.buf_kv"] = st.buf_kv[slot, :o]
            out[f"{i}.{tag}.buf_gate"] = st.buf_gate[slot, :o]
            if st.ov_kv is not None and st.ov_gate is not None and e:
                out[f"{i}.{tag}.ov_kv"] = st.ov_kv[slot]
                out[f"{i}.{tag}.ov_gate"] = st.ov_gate[slot]
    return out


@pytest.mark.parametrize(("name", "dtype"), [(n, torch.float32) for n in SHORT_CONFIGS]
                         + [(SHORT_CONFIGS[0], torch.bfloat16)])
def test_rows_rebuild_the_live_state_for_any_prefix(name: str, dtype: torch.dtype) -> None:
    cfg, ours = _setup(name, dtype)
    ids = torch.randint(2, cfg.vocab_size, (PROMPT + 6,), generator=torch.Generator().manual_seed(3))
    src = DeepseekV4CacheState(cfg, max_batch=2, max_context=CONTEXT, dtype=dtype, device="cpu")
    rows_src = DeepseekV4StateRows.for_model(src, ours)
    rows_src.start_recording(1, PROMPT)
    # Prefill in awkward chunks, keeping the live state at every chunk end: m = 13, 20, 22, 35,
    # 42, 44, 45 (aligned and not to the rates 4/8/12/16, windows 5/6/9 and store chunks).
    live: dict[int, dict[str, torch.Tensor]] = {}
    for s, e in ((0, 13), (13, 20), (20, 22), (22, 35), (35, 42), (42, 44), (44, 45)):
        _run(ours, src, ids[s:e], 1, [e - s])
        live[e] = {k: v.clone() for k, v in _meaningful_state(src, 1).items()}
    rows = rows_src.export_rows(1).clone()
    assert rows.shape == (PROMPT, rows_src.row_width) and rows_src.row_width % 2 == 0
    # Rows are prefix-determined: a prefill of only the first 22 tokens records the same rows.
    rows_src.start_recording(0, 22)
    for s, e in ((0, 13), (13, 20), (20, 22)):
        _run(ours, src, ids[s:e], 0, [e - s])
    assert torch.equal(rows_src.export_rows(0), rows[:22])
    # A closed-entry column is zero where no window closes.
    cols = rows_src.layout.layers
    comp_layer = next(i for i, c in enumerate(cols) if c.compressor is not None)
    cc = cols[comp_layer].compressor
    assert cc is not None
    rate = src.layers[comp_layer].compressor.rate  # type: ignore[union-attr]
    not_closing = [t for t in range(PROMPT) if (t + 1) % rate]
    assert not rows[not_closing][:, cc.entry].any() and rows[rate - 1, cc.entry].any()

    for m, want in live.items():
        dst = DeepseekV4CacheState(cfg, max_batch=3, max_context=CONTEXT, dtype=dtype, device="cpu")
        for _, t in dst.named_tensors():  # garbage in the target slot must not matter
            t.normal_()
        assert DeepseekV4StateRows.for_model(dst, ours).import_rows(2, rows, m) == m
        assert dst.num_tokens[2] == m
        got = _meaningful_state(dst, 2)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), (name, m, key)
    # A slot continued from imported rows computes exactly what the live slot computes.
    for m in (22, PROMPT):
        ref = DeepseekV4CacheState(cfg, max_batch=1, max_context=CONTEXT, dtype=dtype, device="cpu")
        for s, e in ((0, 13), (13, 20), (20, 22), (22, 35), (35, 42), (42, 44), (44, 45)):
            if e <= m:
                _run(ours, ref, ids[s:e], 0, [e - s])
        dst = DeepseekV4CacheState(cfg, max_batch=2, max_context=CONTEXT, dtype=dtype, device="cpu")
        DeepseekV4StateRows.for_model(dst, ours).import_rows(1, rows, m)
        h_ref = _run(ours, ref, ids[m : m + 6], 0, [4, 1])
        h_dst = _run(ours, dst, ids[m : m + 6], 1, [4, 1])
        assert torch.equal(h_ref, h_dst), (name, m)


def test_import_checks_shapes_and_counts() -> None:
    cfg, ours = _setup(SHORT_CONFIGS[0])
    cache = DeepseekV4CacheState(cfg, max_batch=1, max_context=32, dtype=torch.float32, device="cpu")
    rows = DeepseekV4StateRows.for_model(cache, ours)
    width = StateRowLayout.from_config(cfg).row_width
    with pytest.raises(InvalidRequest, match="expected"):
        rows.import_rows(0, torch.zeros(4, width + 2), 4)
    with pytest.raises(InvalidRequest, match="expected"):
        rows.import_rows(0, torch.zeros(4, width, dtype=torch.float64), 4)
    with pytest.raises(InvalidRequest, match="cannot import 5"):
        rows.import_rows(0, torch.zeros(4, width), 5)
    with pytest.raises(InvalidRequest, match="not recorded"):
        rows.export_rows(0)
    # the fingerprint names the state layout and the row encoding
    assert cache.fingerprint in rows.fingerprint and "rows-v1" in rows.fingerprint


def test_engine_keeps_the_slot_and_imports_rows() -> None:
    """keep_kv holds the slot until release() so its rows can be exported; another engine
    imports a prefix of them through kv_import (per-slot keywords) and decodes exactly as
    transformers' generate, whatever prefix it got."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_config import ModelConfig
    from engine.sampling_params import SamplingParams

    name = SHORT_CONFIGS[0]
    model, _ = build_hf_v4(name)
    mc = ModelConfig.from_hf_dict(model.config.to_dict())
    ec = EngineConfig(model=name, device="cpu", dtype="float32", max_context=96,
                      chunk_tokens=17, max_batch=1, block_size=16)
    prompt = torch.randint(2, mc.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(9)).tolist()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)[0, PROMPT:].tolist()

    src = LLMEngine(ec, mc, dict(model.state_dict()))
    assert src.slot_state is not None
    src.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                    keep_kv=True)
    first = None
    while src.has_unfinished():
        for o in src.step():
            first = o.new_token_ids[-1] if o.new_token_ids else first
    assert first == ref[0]
    slot = src.kept_slot("p")
    rows = src.slot_state.export_rows(slot, src.kept_kv("p")[1]).clone()
    assert rows.shape[0] == PROMPT
    # max_batch=1 and the slot is kept: another request waits until release()
    src.add_request("q", prompt[:5], SamplingParams(max_tokens=1, temperature=0))
    assert src.step() == [] and src.stats().num_waiting == 1
    assert src.release("p") and not src.slot_state.is_recording(slot)
    while src.has_unfinished():
        src.step()

    dst = LLMEngine(ec, mc, dict(model.state_dict()))
    for m in (PROMPT, 32, 7):
        calls: list[dict] = []

        def kv_import(kv, block_ids, num_prompt_tokens, *, num_computed_tokens=0, m=m, calls=calls,
                      **per_slot):
            calls.append(per_slot)
            n = min(m, per_slot["max_tokens"])
            return per_slot["slot_state"].import_rows(per_slot["cache_slot"], rows, n)

        dst.add_request(f"d{m}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        kv_import=kv_import, first_token_id=first)
        got, outs = [first], []
        while dst.has_unfinished():
            for o in dst.step():
                got += o.new_token_ids
                outs.append(o)
        assert got == ref, m
        assert calls and calls[0]["max_tokens"] == PROMPT
        assert outs[-1].num_imported_tokens == m
