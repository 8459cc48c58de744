"""BlockConnector against the layouts' own block export (the specification), for the dense
paged K/V and the DeepSeek-V4 pool, on awkward shapes: odd head dims, block ids out of order,
block bytes that need padding, chunks skipped by ``skip_tokens``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.models.family import family_class
from tests.worker.kv_peer import dense_layout
from worker.kv_store_config import KVStoreConfig
from worker.lmcache_connector import BlockConnector, HostBlocks


def _v4_layout(block_size: int, kv_dtype: str):  # noqa: ANN202 - a V4KVLayout
    from tests.engine.deepseek_v4.conftest import _BASE, CONFIGS

    raw = {**_BASE, **CONFIGS["s-csa-hca_yarn_hc2"], "model_type": "deepseek_v4"}
    mc = ModelConfig.from_hf_dict(raw)
    ec = EngineConfig(model="v4", device="cpu", dtype="float32", block_size=block_size,
                      kv_dtype=kv_dtype, max_batch=2)
    return family_class(mc).kv_layout(mc, ec)


LAYOUTS = {
    "dense": lambda: dense_layout({"num_layers": 3, "num_kv_heads": 2, "head_dim": 13,
                                   "dtype": "bfloat16", "block_size": 4}),
    "v4": lambda: _v4_layout(8, "auto"),
    "v4-fp8": lambda: _v4_layout(16, "fp8"),
}


def _random_storage(layout, num_blocks: int, seed: int):  # noqa: ANN001, ANN202
    """Random bytes in every block."""
    kv = layout.allocate(num_blocks, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (num_blocks, layout.bytes_per_block), dtype=torch.uint8,
                         generator=g)
    layout.import_blocks(kv, list(range(num_blocks)), data)
    return kv


def _connector(layout) -> BlockConnector:  # noqa: ANN001
    cfg = KVStoreConfig(url="redis://h:1", model_name="m", engine_layout=layout.fingerprint,
                        block_size=layout.block_size, bytes_per_block=layout.bytes_per_block,
                        chunk_size=layout.block_size * 4)
    return BlockConnector(cfg.block_size, cfg.bytes_per_block, cfg.padded_block_bytes)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_blocks_round_trip_bit_exact_and_skip_shared_blocks(name: str) -> None:
    layout = LAYOUTS[name]()
    bs = layout.block_size
    conn = _connector(layout)
    src = _random_storage(layout, 9, seed=1)
    src_table = [7, 2, 5, 1, 8]
    start, end = bs, 4 * bs  # blocks 1..3 of the sequence (one chunk's worth)
    obj = SimpleNamespace(tensor=torch.empty(conn.get_shape(end - start), dtype=torch.uint8))
    conn.from_gpu(obj, start, end, kv_data=src, layout=layout, block_ids=src_table)
    dst = _random_storage(layout, 9, seed=2)
    before = layout.export_blocks(dst, list(range(9)))
    dst_table = [3, 6, 4, 0, 2]
    conn.to_gpu(obj, start, end, kv_data=dst, layout=layout, block_ids=dst_table,
                skip_tokens=2 * bs - 1)  # the sequence's 2 first blocks are the engine's own
    after = layout.export_blocks(dst, list(range(9)))
    want = layout.export_blocks(src, src_table[2:4])
    assert torch.equal(after[dst_table[2:4]], want)  # bit-exact (FP8 scales included)
    untouched = [b for b in range(9) if b not in dst_table[2:4]]
    assert torch.equal(after[untouched], before[untouched])


def test_host_staging_layout_and_misaligned_ranges() -> None:
    layout = LAYOUTS["v4"]()
    conn = _connector(layout)
    src = _random_storage(layout, 5, seed=3)
    obj = SimpleNamespace(tensor=torch.empty(conn.get_shape(16), dtype=torch.uint8))
    conn.from_gpu(obj, 0, 16, kv_data=src, layout=layout, block_ids=[4, 1])
    staged = torch.zeros(2, layout.bytes_per_block, dtype=torch.uint8)
    conn.to_gpu(obj, 0, 16, kv_data=staged, layout=HostBlocks, block_ids=[0, 1])
    assert torch.equal(staged, layout.export_blocks(src, [4, 1]))
    with pytest.raises(ValueError, match="not whole blocks"):
        conn.from_gpu(obj, 0, 12, kv_data=src, layout=layout, block_ids=[4, 1])
    with pytest.raises(TypeError, match="'layout'"):
        conn.from_gpu(obj, 0, 16, kv_data=src, block_ids=[4, 1])
