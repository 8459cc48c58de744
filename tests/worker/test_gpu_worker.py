"""GPU tier: the decode worker served in-process on CUDA (engine thread on the device) streams
the same greedy tokens as transformers on the same GPU, and the KV import copy (host staging ->
paged device KV) lands every block where it belongs."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from common.settings import WorkerSettings
from decode_worker.server import DecodeServicer
from proto import bulkhead_pb2 as pb
from proto import bulkhead_pb2_grpc as pb_grpc
from tests.helpers.loop_thread import LoopThread
from tests.worker.kv_peer import dense_layout
from worker.worker_base import build_runtime, start_server

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def hf_greedy_cuda(folder: Path, prompt: list[int], n: int) -> list[int]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_decode_worker_streams_on_cuda(tiny_llama: Path) -> None:
    settings = WorkerSettings(role="decode", model=str(tiny_llama), device="cuda",
                              dtype="float32", max_context=512, chunk_tokens=64, max_batch=4,
                              block_size=16, attn_tile_tokens=64)
    rt = build_runtime(settings)
    lt = LoopThread()
    running = lt.run(start_server(rt, DecodeServicer, "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.WorkerStub(channel)
            for n in (7, 150):
                prompt = [(13 * i + n) % 300 + 4 for i in range(n)]
                req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
                    max_tokens=12, temperature=0.0, ignore_eos=True))
                tokens = [t for c in stub.Generate(req, timeout=120) for t in c.token_ids]
                assert tokens == hf_greedy_cuda(tiny_llama, prompt, 12)
            info = stub.GetInfo(pb.WorkerInfoRequest(), timeout=5)
            assert info.steps_completed > 0 and info.num_running == 0
    finally:
        lt.run(running.stop(1.0))
        rt.close()
        lt.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_import_blocks_into_cuda_kv(dtype: str) -> None:
    layout = dense_layout({"num_layers": 3, "num_kv_heads": 2, "head_dim": 24, "dtype": dtype,
                           "block_size": 8})
    src = layout.allocate(7, torch.device("cpu"))
    src.data.normal_(generator=torch.Generator().manual_seed(0))
    staged = layout.export_blocks(src, [1, 2, 3, 4, 5, 6])  # host staging, as fetched
    kv = layout.allocate(11, torch.device("cuda"))
    block_ids = [9, 2, 7, 1, 5, 10]
    layout.import_blocks(kv, block_ids[1:], staged[1:])  # the first block was the engine's own
    assert torch.equal(kv.data[:, :, block_ids[1:]].cpu(), src.data[:, :, 2:7])
    assert int((kv.data != 0).any(dim=(0, 1, 3, 4, 5)).sum()) == 5
