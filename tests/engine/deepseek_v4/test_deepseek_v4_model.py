"""DeepSeek-V4 family against transformers' DeepseekV4ForCausalLM: same logits and greedy tokens
for prompts prefilled in chunks that straddle compression windows, then decoded token by token;
several sequences in one step; export/import of blocks and resumption at a block boundary;
the fixed pool never grows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.errors import InvalidRequest
from engine.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4KVPool,
    DeepseekV4Model,
    V4Backend,
    deepseek_v4_cache_bytes,
)

PROMPT_LEN = 41  # odd on purpose: 10 CSA windows + 1 open token, HCA windows + a remainder
NEW_TOKENS = 10
ATOL = 2e-5


def _ours(model: torch.nn.Module, raw: dict[str, Any]) -> tuple[DeepseekV4Config, DeepseekV4Model]:
    cfg = DeepseekV4Config.from_hf_dict(raw)
    return cfg, DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=torch.float32)


def _prompt(seed: int, n: int = PROMPT_LEN, vocab: int = 97) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(ours: DeepseekV4Model, cache: DeepseekV4KVPool, ids: torch.Tensor, slot: int,
             chunk: int) -> torch.Tensor:
    """Chunked prefill of ``ids`` into ``slot``; returns the logits of every prompt token."""
    logits = []
    start = cache.num_tokens[slot]
    for s in range(0, ids.numel(), chunk):
        e = min(ids.numel(), s + chunk)
        h = ours(ids[s:e], torch.arange(start + s, start + e), [0, e - s], [slot], cache)
        logits.append(ours.compute_logits(h))
    return torch.cat(logits)


def _decode(ours: DeepseekV4Model, cache: DeepseekV4KVPool, first_logits: torch.Tensor,
            slot: int, steps: int) -> tuple[list[int], torch.Tensor]:
    tokens = [int(first_logits.argmax())]
    all_logits = [first_logits]
    for _ in range(steps - 1):
        pos = cache.num_tokens[slot]
        h = ours(torch.tensor([tokens[-1]]), torch.tensor([pos]), [0, 1], [slot], cache)
        lg = ours.compute_logits(h)[0]
        all_logits.append(lg)
        tokens.append(int(lg.argmax()))
    return tokens, torch.stack(all_logits)


def test_config_parse_matches_transformers(hf_v4: tuple[str, torch.nn.Module, dict[str, Any]]) -> None:
    _, model, raw = hf_v4
    hc = model.config
    cfg = DeepseekV4Config.from_hf_dict(raw)
    assert cfg.layer_types == tuple(hc.layer_types)
    assert cfg.mlp_layer_types == tuple(hc.mlp_layer_types)
    assert cfg.csa_rate == hc.compress_rates["compressed_sparse_attention"]
    assert cfg.hca_rate == hc.compress_rates["heavily_compressed_attention"]
    assert cfg.rope_head_dim == hc.qk_rope_head_dim
    # and the dict transformers writes back (nested rope_parameters) parses the same way
    assert DeepseekV4Config.from_hf_dict(hc.to_dict()) == cfg


@pytest.mark.parametrize("chunk", [PROMPT_LEN, 7, 3, 1])
def test_chunked_prefill_logits_match(hf_v4: tuple[str, torch.nn.Module, dict[str, Any]], chunk: int) -> None:
    name, model, raw = hf_v4
    cfg, ours = _ours(model, raw)
    ids = _prompt(1)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    cache = DeepseekV4KVPool.for_slots(cfg, max_batch=2, max_context=64, dtype=torch.float32, device="cpu")
    got = _prefill(ours, cache, ids, slot=1, chunk=chunk)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=1e-4, msg=f"{name} chunk={chunk}")


@pytest.mark.parametrize("chunk", [PROMPT_LEN, 6])
def test_greedy_tokens_match_generate(hf_v4: tuple[str, torch.nn.Module, dict[str, Any]], chunk: int) -> None:
    name, model, raw = hf_v4
    cfg, ours = _ours(model, raw)
    ids = _prompt(2)
    g = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    hf_tokens = g.sequences[0, PROMPT_LEN:].tolist()
    hf_logits = torch.stack([lg[0] for lg in g.logits])
    cache = DeepseekV4KVPool.for_slots(cfg, max_batch=1, max_context=64, dtype=torch.float32, device="cpu")
    prompt_logits = _prefill(ours, cache, ids, slot=0, chunk=chunk)
    tokens, logits = _decode(ours, cache, prompt_logits[-1], slot=0, steps=NEW_TOKENS)
    assert tokens == hf_tokens, name
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=1e-4)
    assert cache.num_tokens[0] == PROMPT_LEN + NEW_TOKENS - 1


@pytest.mark.parametrize("backend", [V4Backend("torch", "torch"), V4Backend("kernels_ref", "kernels_ref")],
                         ids=["torch", "kernels_ref"])
def test_mixed_batch_equals_single_sequences(hf_v4: tuple[str, torch.nn.Module, dict[str, Any]],
                                             backend: V4Backend) -> None:
    """One step holding a decode token of slot 2, a prefill chunk of slot 0 and a chunk of a
    fresh slot 1 gives the same logits as running each sequence alone (the kernels backends
    attend for all sequences in one call, over the flat windows and entry tables)."""
    _, model, raw = hf_v4
    cfg = DeepseekV4Config.from_hf_dict(raw)
    ours = DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=torch.float32, backend=backend)
    a, b, c = _prompt(3, 23), _prompt(4, 13), _prompt(5, 30)
    solo = DeepseekV4KVPool.for_slots(cfg, max_batch=3, max_context=64, dtype=torch.float32, device="cpu")
    ref_a = _prefill(ours, solo, a, 0, 23)[10:]
    ref_b = _prefill(ours, solo, b, 1, 13)
    ref_c = _prefill(ours, solo, c, 2, 30)[-1:]
    cache = DeepseekV4KVPool.for_slots(cfg, max_batch=3, max_context=64, dtype=torch.float32, device="cpu")
    _prefill(ours, cache, a[:10], 0, 10)
    _prefill(ours, cache, c[:29], 2, 29)
    ids = torch.cat([c[29:], a[10:], b])
    pos = torch.cat([torch.tensor([29]), torch.arange(10, 23), torch.arange(0, 13)])
    h = ours(ids, pos, [0, 1, 14, 27], [2, 0, 1], cache)
    got = ours.compute_logits(h)
    torch.testing.assert_close(got, torch.cat([ref_c, ref_a, ref_b]), atol=ATOL, rtol=1e-4)
    assert cache.num_tokens == [23, 13, 30]


def test_export_import_blocks_continues_identically(hf_v4: tuple[str, torch.nn.Module, dict[str, Any]]) -> None:
    """Prefill on one pool (the 'prefill worker'), move its full blocks as bytes into another
    pool's blocks of a different slot, resume there at the block boundary, compute the rest of
    the prompt and decode: same tokens as decoding in place."""
    _, model, raw = hf_v4
    cfg, ours = _ours(model, raw)
    ids = _prompt(6)
    src = DeepseekV4KVPool.for_slots(cfg, max_batch=2, max_context=64, dtype=torch.float32, device="cpu")
    logits = _prefill(ours, src, ids, 1, 9)
    bs = src.block_size
    full = PROMPT_LEN // bs
    assert full >= 1
    data = src.export_blocks(src.static_tables[1][:full])
    # each block's entries, indexer keys and carry; the window travels once, for the resume
    # point (every 9-token chunk here crosses one block end, so each block end has one)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (full, src.bytes_per_block)
    window = src.export_window(src.static_tables[1][full - 1])
    assert window is not None
    dst = DeepseekV4KVPool.for_slots(cfg, max_batch=3, max_context=64, dtype=torch.float32, device="cpu")
    ptrs = [t.data_ptr() for t in dst.block_tensors() + dst.slot_tensors() + dst.window_tensors()]
    dst.import_blocks(dst.static_tables[2][:full], data)
    assert dst.resumable_tokens(dst.static_tables[2], PROMPT_LEN) == 0  # no window yet
    dst.import_window(dst.static_tables[2][full - 1], window)
    assert [t.data_ptr() for t in dst.block_tensors() + dst.slot_tensors()
            + dst.window_tensors()] == ptrs
    table = dst.table(2, None)
    assert dst.resumable_tokens(table.tolist(), PROMPT_LEN) == full * bs
    dst.restore_slot(2, dst.table(2, None), full * bs)
    tail = _prefill(ours, dst, ids[full * bs:], 2, 5)
    torch.testing.assert_close(tail[-1], logits[-1], atol=ATOL, rtol=1e-4)
    want, _ = _decode(ours, src, logits[-1], 1, 6)
    got, _ = _decode(ours, dst, logits[-1], 2, 6)
    assert got == want


def test_import_rejects_other_layout(v4_builder: Callable[..., Any]) -> None:
    _, raw_a = v4_builder("s-csa-hca_yarn_hc2")
    _, raw_b = v4_builder("csa-hca-csa-s_hc3_topk_all")
    a = DeepseekV4KVPool.for_slots(DeepseekV4Config.from_hf_dict(raw_a), 1, 32, torch.float32, "cpu")
    b = DeepseekV4KVPool.for_slots(DeepseekV4Config.from_hf_dict(raw_b), 1, 32, torch.float32, "cpu")
    assert a.fingerprint != b.fingerprint
    with pytest.raises(InvalidRequest, match="V4 block data"):
        b.import_blocks([1], a.export_blocks([1]))


def test_fixed_extent_never_grows_and_rejects_overflow(hf_v4: tuple[str, torch.nn.Module, dict[str, Any]]) -> None:
    _, model, raw = hf_v4
    cfg, ours = _ours(model, raw)
    cache = DeepseekV4KVPool.for_slots(cfg, max_batch=2, max_context=48, dtype=torch.float32, device="cpu")
    assert sum(deepseek_v4_cache_bytes(cfg, 2, 48, torch.float32).values()) == cache.nbytes()
    before = [(t.data_ptr(), tuple(t.shape)) for t in cache.block_tensors() + cache.slot_tensors()]
    _prefill(ours, cache, _prompt(7, 45), 0, 11)
    assert [(t.data_ptr(), tuple(t.shape)) for t in cache.block_tensors() + cache.slot_tensors()] == before
    with pytest.raises(InvalidRequest, match="exceed its"):
        ours(torch.tensor([3, 4, 5, 6]), torch.arange(45, 49), [0, 4], [0], cache)
    assert cache.num_tokens[0] == 45  # a refused step leaves the slot untouched


@pytest.mark.parametrize("backend", [V4Backend("kernels_ref", "kernels_ref"), V4Backend("naive", "torch")],
                         ids=["kernels_ref", "naive_indexer"])
def test_kernel_references_as_backend_match(backend: V4Backend, v4_builder: Callable[..., Any]) -> None:
    """The kernels package's PyTorch references (the specification of its Triton kernels), and
    the naive indexer, plugged into the model give transformers' logits."""
    model, raw = v4_builder("s-csa-hca_yarn_hc2")
    cfg = DeepseekV4Config.from_hf_dict(raw)
    ours = DeepseekV4Model.from_state_dict(cfg, model.state_dict(), dtype=torch.float32, backend=backend)
    ids = _prompt(8, 30)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    cache = DeepseekV4KVPool.for_slots(cfg, max_batch=1, max_context=32, dtype=torch.float32, device="cpu")
    torch.testing.assert_close(_prefill(ours, cache, ids, 0, 7), ref, atol=ATOL, rtol=1e-4)


def test_flash_rates_long_prompt(v4_builder: Callable[..., Any]) -> None:
    """Rates 4 / 128 and window 128 as in V4-Flash: a 380-token prompt in 61-token chunks (not
    dividing either rate), then greedy decode across the HCA window closing at token 384."""
    model, raw = v4_builder("flash_rates_window128")
    cfg, ours = _ours(model, raw)
    ids = _prompt(9, 380)
    g = model.generate(ids[None], max_new_tokens=6, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    cache = DeepseekV4KVPool.for_slots(cfg, max_batch=1, max_context=400, dtype=torch.float32, device="cpu")
    logits = _prefill(ours, cache, ids, slot=0, chunk=61)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)
    tokens, step_logits = _decode(ours, cache, logits[-1], 0, 6)
    assert tokens == g.sequences[0, 380:].tolist()
    torch.testing.assert_close(step_logits, torch.stack([lg[0] for lg in g.logits]), atol=ATOL, rtol=1e-4)
