"""DeepSeek-V4 through the split path: prefill worker -> LMCache (whole blocks of the V4 pool:
compressed entries, indexer keys, CSA carry) + one Redis key per resume point (the window
snapshot at a block end) -> Redis -> decode worker, each its own OS process (the CLI), driven
over gRPC, on a tiny random DeepseekV4 checkpoint written with transformers' save_pretrained.

The decode worker LOADS the prompt's whole blocks (its engine computes only the partial last
block and the decode tokens), the greedy tokens equal transformers' generate, and when one
chunk's keys, or the resume point at the end of the stored prefix, or every resume point, are
deleted from Redis, the decode worker loads the longest prefix that still ends at a stored resume
point, recomputes the rest, and answers the same."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch

from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.engine.deepseek_v4.conftest import SHORT_CONFIGS, build_hf_v4
from tests.helpers.worker_pair import handoff_flags, worker_pair
from worker.resume_points import KEY_PREFIX

BLOCK = 8  # V4 blocks of 8 tokens: the lcm of the rates 4 and 8
CHUNK = 16  # LMCache chunk: two blocks
PROMPT = 53  # not a multiple of the block, the chunk, the rates or the engine chunk (17)
STORED = PROMPT // BLOCK * BLOCK  # whole blocks only: 48 = 3 chunks
NEW = 8
WORKER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-context", "128",
                "--chunk-tokens", "17", "--max-batch", "2", "--block-size", str(BLOCK),
                "--attn-tile-tokens", str(4 * BLOCK), *handoff_flags(CHUNK)]


@dataclass
class Pair:
    prefill: pb_grpc.WorkerStub
    decode: pb_grpc.WorkerStub
    redis_url: str
    hf_model: torch.nn.Module
    vocab: int


@pytest.fixture(scope="module")
def v4_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model, _ = build_hf_v4(SHORT_CONFIGS[0])  # sliding + CSA (rate 4) + HCA (rate 8), window 6
    folder = tmp_path_factory.mktemp("tiny-v4")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def pair(v4_folder: tuple[Path, torch.nn.Module], redis_url: str,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder, model = v4_folder
    log_dir = tmp_path_factory.mktemp("handoff-v4-logs")
    with worker_pair(folder, redis_url, WORKER_FLAGS, log_dir) as (prefill, decode, _):
        yield Pair(prefill, decode, redis_url, model, model.config.vocab_size)


def prompt_of(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


def prefill(pair: Pair, prompt: list[int], rid: str, max_tokens: int = NEW) -> pb.PrefillResponse:
    return pair.prefill.Prefill(pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)), timeout=120)


def decode(pair: Pair, prompt: list[int], resp: pb.PrefillResponse, rid: str
           ) -> tuple[list[int], pb.Usage, int]:
    """Generate after the prefill; returns (tokens incl. the first, usage, tokens the decode
    engine computed for this request)."""
    before = pair.decode.GetInfo(pb.WorkerInfoRequest(), timeout=5).tokens_advanced
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling=pb.SamplingParams(max_tokens=NEW, temperature=0.0),
                             has_prefill=True, first_token_id=resp.first_token_id, kv=resp.kv)
    tokens, usage = [resp.first_token_id], None
    for chunk in pair.decode.Generate(req, timeout=120):
        tokens += list(chunk.token_ids)
        if chunk.finish_reason:
            usage = chunk.usage
    assert usage is not None
    after = pair.decode.GetInfo(pb.WorkerInfoRequest(), timeout=5).tokens_advanced
    return tokens, usage, after - before


def new_keys(r: redis.Redis, before: set[bytes]) -> tuple[set[bytes], set[bytes]]:
    """Keys added since ``before``: (LMCache chunk keys, resume point keys)."""
    added = set(r.keys("*")) - before
    resume = {k for k in added if k.startswith(KEY_PREFIX.encode())}
    return added - resume, resume


def window_bytes(folder: Path) -> int:
    """One window snapshot of the tiny model in float32: layers x window x head_dim x 4."""
    import json

    raw = json.loads((folder / "config.json").read_text())
    return raw["num_hidden_layers"] * raw["sliding_window"] * raw["head_dim"] * 4


def wait_lookup(pair: Pair, prompt: list[int], want: int) -> None:
    deadline = time.monotonic() + 10
    while pair.decode.Lookup(pb.LookupRequest(prompt_token_ids=prompt),
                             timeout=5).num_cached_tokens != want:
        assert time.monotonic() < deadline, f"the decode worker never sees {want} tokens"
        time.sleep(0.05)


def test_checkpoint_is_read_by_the_engine_loader(v4_folder: tuple[Path, torch.nn.Module]) -> None:
    from engine.checkpoint import load_checkpoint

    folder, model = v4_folder
    ckpt = load_checkpoint(folder, dtype=torch.float32, progress=False)
    assert ckpt.config.family == "deepseek_v4"
    assert ckpt.config.num_layers == model.config.num_hidden_layers
    assert ckpt.state_dict


def test_decode_loads_the_prefilled_state(pair: Pair, v4_folder: tuple[Path, torch.nn.Module]
                                          ) -> None:
    prompt = prompt_of(PROMPT, 1, pair.vocab)
    r = redis.Redis.from_url(pair.redis_url)
    before = set(r.keys("*"))
    resp = prefill(pair, prompt, "v1")
    assert resp.kv.num_tokens_stored == STORED and resp.num_computed_tokens == PROMPT
    # compact: the window travels once per resume point (the block end of each 17-token
    # prefill step: 16, 32, 48), not in every block
    chunks, resume = new_keys(r, before)
    assert len(chunks) == 2 * STORED // CHUNK and len(resume) == 3
    assert {r.strlen(k) for k in resume} == {window_bytes(v4_folder[0])}
    info = pair.decode.GetInfo(pb.WorkerInfoRequest(), timeout=5)
    assert resp.kv.kv_layout_fingerprint == info.compat.kv_layout_fingerprint
    tokens, usage, computed = decode(pair, prompt, resp, "v1")
    assert tokens == hf_greedy(pair.hf_model, prompt, NEW)
    assert usage.loaded_kv_tokens == STORED and usage.recomputed_tokens == PROMPT - STORED
    # LOADED, not recomputed: the decode engine ran only the partial last block and the NEW - 1
    # tokens after the first.
    assert computed == (PROMPT - STORED) + NEW - 1
    lookup = pair.decode.Lookup(pb.LookupRequest(prompt_token_ids=prompt), timeout=5)
    assert lookup.num_cached_tokens == STORED
    # The prefill worker gave its slot back after the reply (max_batch 2: two more fit).
    assert pair.prefill.GetInfo(pb.WorkerInfoRequest(), timeout=5).num_running == 0


def test_deleted_chunk_loads_a_shorter_prefix(pair: Pair) -> None:
    prompt = prompt_of(PROMPT, 2, pair.vocab)
    r = redis.Redis.from_url(pair.redis_url)
    # Store the prompt in steps, so the keys of chunk 3 (tokens [32, 48)) are known: they are
    # what a prefill of 48 tokens adds to a prefill of 32.
    prefill(pair, prompt[:2 * CHUNK], "v2-a", max_tokens=2)
    keys_16 = set(r.keys("*"))
    prefill(pair, prompt[:3 * CHUNK], "v2-b", max_tokens=2)
    chunk3, resume48 = new_keys(r, keys_16)
    assert len(chunk3) == 2 and len(resume48) == 1  # <key>kv_bytes and <key>metadata; at 48
    resp = prefill(pair, prompt, "v2")
    assert resp.kv.num_tokens_stored == STORED
    # the prefill worker's own prefix cache held the blocks of the first 48 tokens
    assert resp.num_cached_tokens == 3 * CHUNK

    assert r.delete(*chunk3) == 2
    wait_lookup(pair, prompt, 2 * CHUNK)
    tokens, usage, computed = decode(pair, prompt, resp, "v2-cut")
    assert usage.loaded_kv_tokens == 2 * CHUNK and usage.recomputed_tokens == PROMPT - 2 * CHUNK
    assert computed == (PROMPT + 1 - 2 * CHUNK) + (NEW - 2)
    assert tokens == hf_greedy(pair.hf_model, prompt, NEW)  # equals a cold run

    # The same conversation again on the decode worker: its own prefix cache now holds the
    # blocks (V4 prefix sharing inside a worker), nothing is loaded, the tokens are the same.
    again, usage, computed = decode(pair, prompt, resp, "v2-again")
    assert usage.cached_tokens == STORED and usage.loaded_kv_tokens == 0
    assert computed == (PROMPT + 1 - STORED) + (NEW - 2)
    assert again == tokens


@pytest.mark.parametrize(("seed", "drop"), [(3, "last"), (4, "all")])
def test_deleted_resume_point_loads_a_shorter_prefix(pair: Pair, seed: int, drop: str) -> None:
    """The blocks are all stored but the resume point at their end (or every one) is gone: the
    decode worker loads up to the last resume point still stored (32, or nothing) and
    recomputes the rest; the answer equals a cold run."""
    prompt = prompt_of(PROMPT, seed, pair.vocab)
    r = redis.Redis.from_url(pair.redis_url)
    before = set(r.keys("*"))
    prefill(pair, prompt[:2 * CHUNK], f"r{seed}-a", max_tokens=2)
    _, resume32 = new_keys(r, before)
    keys_32 = set(r.keys("*"))
    resp = prefill(pair, prompt, f"r{seed}")
    assert resp.kv.num_tokens_stored == STORED
    _, resume48 = new_keys(r, keys_32)
    assert len(resume32) == 2 and len(resume48) == 1  # ends 16, 32; then 48
    wait_lookup(pair, prompt, STORED)
    gone = resume48 if drop == "last" else resume32 | resume48
    assert r.delete(*gone) == len(gone)
    loadable = 2 * CHUNK if drop == "last" else 0
    wait_lookup(pair, prompt, loadable)
    tokens, usage, computed = decode(pair, prompt, resp, f"r{seed}-cut")
    assert usage.loaded_kv_tokens == loadable and usage.recomputed_tokens == PROMPT - loadable
    assert computed == (PROMPT - loadable) + NEW - 1
    assert tokens == hf_greedy(pair.hf_model, prompt, NEW)  # equals a cold run
