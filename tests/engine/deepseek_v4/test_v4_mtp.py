"""DeepSeek-V4's MTP layers (engine/models/deepseek_v4/layers/mtp.py): read from a checkpoint in
DeepSeek's layout (``mtp.{i}.*``), their forward equals a plain reference built on
transformers' own V4 layer (chunked and one token at a time, through the layer's window ring),
and a checkpoint without them refuses ``speculative_method=mtp``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.config import EngineConfig
from engine.errors import PlanError
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4KVPool, DeepseekV4Model
from engine.models.deepseek_v4.layers.mtp import (
    V4MTPLayer,
    mtp_config,
    mtp_layer_count,
    split_mtp_weights,
)
from engine.models.deepseek_v4.memory.extent import block_multiple
from engine.sampling_params import SamplingParams
from engine.scoring import greedy_batch
from tests.engine.deepseek_v4._mtp_ckpt import main_streams, reference_mtp_logits, write_v4_with_mtp


def test_mtp_layer_matches_reference(tmp_path: Path) -> None:
    main, auxes, glues = write_v4_with_mtp("s-csa-hca_yarn_hc2", tmp_path, num_mtp=2)
    ck = load_checkpoint(tmp_path, torch.float32, progress=False)
    assert mtp_layer_count(ck.state_dict) == 2
    cfg = DeepseekV4Config.from_hf_dict(ck.config.hf_config)
    layers = split_mtp_weights(ck.state_dict, cfg.num_layers, torch.float32)
    ours = DeepseekV4Model.from_state_dict(cfg, ck.state_dict, dtype=torch.float32)
    ids = torch.randint(2, 97, (23,), generator=torch.Generator().manual_seed(4))
    h = main_streams(main, ids)[:-1]  # position p: the main model's streams at p ...
    nxt = ids[1:]  # ... and the token at p + 1
    n = nxt.numel()
    for i, (aux, glue) in enumerate(zip(auxes, glues, strict=True)):
        mtp = V4MTPLayer.build(cfg, layers[i], ours, torch.float32, "cpu")
        want, want_streams = reference_mtp_logits(aux, glue, h, nxt, aux.config.rms_norm_eps)
        pool = DeepseekV4KVPool.for_slots(mtp_config(cfg), 1, 32, torch.float32, "cpu")
        split = 13  # a chunk, then one token at a time through the window ring
        got = []
        with torch.no_grad():
            mtp.h_in = h[:split]
            got.append(mtp.compute_logits(mtp(nxt[:split], torch.arange(split), [0, split], [0], pool)))
            for p in range(split, n):
                mtp.h_in = h[p:p + 1]
                got.append(mtp.compute_logits(mtp(nxt[p:p + 1], torch.tensor([p]), [0, 1], [0], pool)))
        torch.testing.assert_close(torch.cat(got), want, atol=2e-5, rtol=1e-4)
        assert mtp.streams_out is not None
        torch.testing.assert_close(mtp.streams_out[0], want_streams[-1], atol=2e-5, rtol=1e-4)


def _mtp_engine(folder: Path, method: str, k: int = 3) -> LLMEngine:
    ck = load_checkpoint(folder, torch.float32, progress=False)
    bs = block_multiple(DeepseekV4Config.from_hf_dict(ck.config.hf_config))
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", max_batch=3, max_context=160,
                      chunk_tokens=32, block_size=bs, attn_tile_tokens=bs,
                      speculative_method=method, num_speculative_tokens=k)
    return LLMEngine(ec, ck.config, ck.state_dict)


def _greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> dict[str, list[int]]:
    return greedy_batch(engine, prompts, new)


@pytest.mark.parametrize("name", ["s-csa-hca_yarn_hc2", "legacy_fields_hc1_csa8"])
def test_mtp_greedy_identical(tmp_path: Path, name: str) -> None:
    """Greedy tokens with MTP drafts (k = 3, one MTP layer drafting recurrently) equal greedy
    tokens without speculation; drafts are verified, some kept, some rejected (rollbacks)."""
    write_v4_with_mtp(name, tmp_path, num_mtp=1)
    g = torch.Generator().manual_seed(3)
    prompts = [[7, 8, 9, 10, 11, 12] * 6, torch.randint(2, 97, (29,), generator=g).tolist(),
               [5, 6, 5, 6, 5, 6, 5]]
    want = _greedy(_mtp_engine(tmp_path, "none"), prompts, 60)
    spec = _mtp_engine(tmp_path, "mtp")
    # the plan's terms are the bytes the family holds
    fam = spec.runner.model
    assert fam.snapshots is not None and fam.mtp is not None
    assert spec.plan.term("verify_snapshots") == fam.snapshots.nbytes() > 0
    mtp = fam.mtp
    held = (mtp.pool.nbytes() + mtp.deferred.numel() * mtp.deferred.element_size()
            + mtp.snapshots.nbytes())
    assert spec.plan.term("mtp_state") == held > 0
    got = _greedy(spec, prompts, 60)
    assert got == want
    st = spec.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_accepted_tokens > 0, st
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens, st


def test_checkpoint_without_mtp_refuses_mtp(v4_builder: Callable[..., Any], tmp_path: Path) -> None:
    model, _ = v4_builder("s-csa-hca_yarn_hc2")
    model.save_pretrained(tmp_path)
    with pytest.raises(PlanError, match=r"speculative_method=mtp: this checkpoint has no MTP "
                                        r"layers .*num_nextn_predict_layers"):
        _mtp_engine(tmp_path, "mtp")


def test_dense_family_refuses_mtp(tmp_path: Path) -> None:
    from tests.helpers.tiny_model import write_tiny_llama

    folder = write_tiny_llama(tmp_path)
    ck = load_checkpoint(folder, torch.float32, progress=False)
    ec = EngineConfig(model="tiny", device="cpu", dtype="float32", max_batch=2, max_context=64,
                      speculative_method="mtp")
    with pytest.raises(PlanError, match="speculative_method=mtp: family .* drafts with ngram only"):
        LLMEngine(ec, ck.config, ck.state_dict)


def test_split_prefill_decode_with_mtp_equals_colocated(tmp_path: Path) -> None:
    """Prefill on one engine (no speculation, as the prefill worker runs), its blocks and the
    window at the last block end imported by a decode engine with MTP drafts: the same tokens as
    one engine with MTP and as plain greedy decoding. What this shows about the MTP layer's
    state: it is NOT carried (no MTP state is in the exported blocks or window); the importing
    slot's MTP window starts cold at the resume point (mtp_drafter.py), drafts still come and are
    verified, and the tokens do not depend on it."""
    from engine.staged_kv import StagedKV
    from tests.engine.parallel.test_tensor_parallel_engine import export_kept

    write_v4_with_mtp("s-csa-hca_yarn_hc2", tmp_path, num_mtp=1)
    prompt = ([7, 8, 9, 10, 11, 12] * 12)[:70]
    new = 40
    src = _mtp_engine(tmp_path, "none")
    ids, data = export_kept(src, prompt)
    bs = src.config.block_size
    window = src.kv_layout.export_resume_state(src.kv_cache, ids[-1])
    assert window is not None
    n = len(ids) * bs
    src.release("keep")
    want = _greedy(src, [prompt], new)["r0"]
    colocated = _greedy(_mtp_engine(tmp_path, "mtp"), [prompt], new)["r0"]
    dst = _mtp_engine(tmp_path, "mtp")
    dst.add_request("split", prompt, SamplingParams(max_tokens=new, temperature=0.0,
                                                    ignore_eos=True),
                    kv_import=StagedKV(data.cpu().clone(), n, n, window.cpu().clone()))
    split: list[int] = []
    imported = 0
    while dst.has_unfinished():
        for o in dst.step():
            split += o.new_token_ids
            imported = max(imported, o.num_imported_tokens)
    assert imported == n > 0  # the prompt's blocks came by import, not recomputed
    assert split == colocated == want
    assert dst.stats().spec_num_drafts > 0  # the cold MTP window still drafts
