"""A prompt's fetched KV imported a bounded slice per engine step (engine/kv_import_job.py), with
a real redis-server, real LMCache and a tiny Llama: the tokens equal a one-slice import, a
colocated run and transformers; running decodes get a token every step of the import; the
prompt gets no chunk until its last slice is in; a request aborted (cancelled or timed out:
the decode worker aborts both) or preempted mid-import gives back its blocks and its host
staging region."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.staged_kv import StagedKV
from tests.helpers.tiny_model import hf_greedy, write_tiny_llama
from worker.kv_import import fetch_import
from worker.kv_store import KVStore

BLOCK, LMCACHE_CHUNK = 8, 16
PROMPT = [(13 * i + 5) % 300 + 4 for i in range(100)]  # 12 whole blocks (96 tokens) stored
STORED_BLOCKS = 12
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
CHAT = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def make_engine(folder: Path, **kw: object) -> LLMEngine:
    cfg = dict(model=str(folder), device="cpu", dtype="float32", max_context=256,
               chunk_tokens=40, max_batch=4, block_size=BLOCK, attn_tile_tokens=64)
    cfg.update(kw)
    return LLMEngine.from_config(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def store(folder: Path, redis_url: str) -> Iterator[KVStore]:
    """The prompt's KV, computed by a prefill engine and stored through LMCache into Redis."""
    prefill = make_engine(folder)
    with KVStore(redis_url, "sliced-import-test", prefill.kv_layout, chunk_size=LMCACHE_CHUNK,
                 staging_gb=0.01) as kv_store:
        prefill.add_request("p", PROMPT, SamplingParams(max_tokens=1, temperature=0.0),
                            keep_kv=True)
        while prefill.has_unfinished():
            prefill.step()
        block_ids, _ = prefill.kept_kv("p")
        assert kv_store.store(PROMPT, prefill.kv_cache, block_ids) == STORED_BLOCKS * BLOCK
        prefill.release("p")
        yield kv_store


def fetch(kv_store: KVStore) -> StagedKV:
    staged = asyncio.run(fetch_import(kv_store, PROMPT))
    assert staged is not None and staged.num_tokens == STORED_BLOCKS * BLOCK
    return staged


def run_with_chat(engine: LLMEngine, kv_import: StagedKV | None) -> tuple[list[int], list[dict]]:
    """A chat decoding when the long prompt arrives (with its fetched KV, or none: colocated);
    returns the long prompt's tokens and, per step from its arrival, who got a token."""
    engine.add_request("chat", [7, 8, 9, 10, 11], CHAT)
    while not [o for o in engine.step() if o.new_token_ids]:  # the chat is decoding
        pass
    engine.add_request("long", PROMPT, GREEDY, kv_import=kv_import)
    del kv_import
    tokens: list[int] = []
    steps: list[dict] = []
    imported = -1
    while engine.has_unfinished():
        got = {o.request_id: o for o in engine.step()}
        steps.append({rid: len(o.new_token_ids) for rid, o in got.items()})
        if "long" in got:
            tokens += got["long"].new_token_ids
            imported = got["long"].num_imported_tokens
        if "long" in got and got["long"].finished:
            engine.abort("chat")
    steps.append({"imported": imported})
    return tokens, steps


def test_sliced_import_equals_one_slice_colocated_and_transformers(
        folder: Path, store: KVStore, caplog: pytest.LogCaptureFixture) -> None:
    colocated = make_engine(folder)
    want, _ = run_with_chat(colocated, None)
    assert want == hf_greedy(folder, PROMPT, NEW, stop_at_eos=False)

    once = make_engine(folder)  # the default bound holds the whole prompt: one slice
    got_once, steps_once = run_with_chat(once, fetch(store))
    first_once = next(i for i, s in enumerate(steps_once) if s.get("long"))

    bpb = store.layout.bytes_per_block
    sliced = make_engine(folder, kv_import_slice_bytes=2 * bpb)
    assert sliced.plan.term("kv_import_slice") == 2 * bpb
    with caplog.at_level(logging.INFO, logger="engine.kv_import_job"):
        got_sliced, steps = run_with_chat(sliced, fetch(store))
    assert got_once == want and got_sliced == want
    assert steps_once[-1]["imported"] == steps[-1]["imported"] == STORED_BLOCKS * BLOCK
    # 12 blocks, 2 a step: the import takes 6 steps, in each of which the chat decodes and the
    # long prompt gets nothing; its first token comes the step after the last slice
    first = next(i for i, s in enumerate(steps) if s.get("long"))
    assert first_once == 1 and first == 6, (steps_once, steps)
    assert all(s.get("chat") == 1 for s in steps[:first + 1]), steps
    line = [r.getMessage() for r in caplog.records if "KV import of long" in r.getMessage()]
    assert len(line) == 1 and "96 tokens in 6 slice(s)" in line[0], line
    assert f"{12 * bpb / 2**20:.1f} MiB" in line[0]


def test_abort_mid_import_gives_back_blocks_and_staging(folder: Path, store: KVStore) -> None:
    engine = make_engine(folder, kv_import_slice_bytes=store.layout.bytes_per_block)
    staging = store._staging
    free_blocks, free_host = engine.block_manager.num_free_blocks, staging.free_bytes
    staged = fetch(store)
    assert staging.free_bytes < free_host
    engine.add_request("long", PROMPT, GREEDY, kv_import=staged)
    del staged
    for _ in range(3):  # admission + 3 of 12 slices
        assert engine.step() == []
    assert "long" in engine._importer and engine.block_manager.num_free_blocks < free_blocks
    assert engine.stats().steps_completed == 3  # import-only steps count as progress
    gc.collect()
    assert staging.free_bytes < free_host  # the import holds its region while it runs
    assert engine.abort("long")
    gc.collect()
    assert staging.free_bytes == free_host and engine._importer.num_parked == 0
    assert engine.block_manager.num_free_blocks == free_blocks
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("long", "abort")]
    assert not engine.has_unfinished()


def test_preempted_mid_import_recomputes_and_frees_its_staging(
        folder: Path, store: KVStore, caplog: pytest.LogCaptureFixture) -> None:
    # A pool of 20 blocks: a chat of 47 tokens holds 6, the long prompt 13 from its admission,
    # the chat's 49th token takes the last one and its 57th needs one more while the prompt is
    # still importing (1 block a step): the latest arrival, the importing prompt, is preempted.
    engine = make_engine(folder, num_blocks=21, max_context=160, chunk_tokens=64,
                         kv_import_slice_bytes=store.layout.bytes_per_block)
    staging = store._staging
    free_host = staging.free_bytes
    engine.add_request("chat", list(range(4, 51)), SamplingParams(max_tokens=60,
                                                                   temperature=0.0,
                                                                   ignore_eos=True))
    engine.step()
    engine.add_request("long", PROMPT, GREEDY, kv_import=fetch(store))
    tokens: list[int] = []
    imported = -1
    caplog.set_level(logging.INFO, logger="engine.kv_import_job")
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "long":
                tokens += o.new_token_ids
                imported = o.num_imported_tokens
    gc.collect()
    assert engine.stats().num_preemptions >= 1
    assert staging.free_bytes == free_host and engine._importer.num_parked == 0
    assert imported == 0  # preempted mid-import: computed instead
    assert any("KV import of long cancelled after 9 of 12" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert tokens == hf_greedy(folder, PROMPT, NEW, stop_at_eos=False)
