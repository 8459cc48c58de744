"""DeepSeek-V4 KV (compressed blocks + the window snapshot at a block end) imported a block per
engine step decodes exactly like a one-slice import, a fresh engine and transformers."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.staged_kv import StagedKV
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS, build_hf_v4
from tests.engine.parallel.test_tensor_parallel_engine import export_kept
from tests.engine.test_engine_deepseek_v4 import NEW, _engine, _reference_uncached

BLOCK = 16


def _decode(engine, prompt: list[int], staged: StagedKV | None) -> tuple[list[int], int, int]:
    """(tokens, imported tokens, steps before the first token)."""
    sp = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    engine.add_request("r", prompt, sp, kv_import=staged)
    tokens: list[int] = []
    imported, steps, first = 0, 0, -1
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            imported = o.num_imported_tokens
            if o.new_token_ids and first < 0:
                first = steps
        steps += 1
    return tokens, imported, first


def test_v4_sliced_import_equals_one_slice_and_a_fresh_run() -> None:
    model, _ = build_hf_v4(SHORT_CONFIGS[0])
    prompt = torch.randint(3, 90, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    src = _engine(model, BLOCK)
    ids, data = export_kept(src, prompt)  # 4 full blocks of 16
    window = src.kv_layout.export_resume_state(src.kv_cache, ids[-1])
    assert window is not None and len(ids) == 4
    src.release("keep")

    def staged() -> StagedKV:
        return StagedKV(data.cpu().clone(), 64, 64, window.cpu().clone())

    fresh, _, _ = _decode(src, prompt, None)
    assert fresh == _reference_uncached(model, prompt)
    once, n_once, first_once = _decode(_engine(model, BLOCK), prompt, staged())
    bpb = src.kv_layout.bytes_per_block
    sliced_engine = _engine(model, BLOCK, kv_import_slice_bytes=bpb)  # a block a step
    assert sliced_engine.plan.term("kv_import_slice") == bpb
    sliced, n_sliced, first = _decode(sliced_engine, prompt, staged())
    assert once == fresh and sliced == fresh
    assert n_once == n_sliced == 64
    # 4 blocks: 4 import steps, then the 6-token tail and the first token
    assert (first_once, first) == (1, 4)
