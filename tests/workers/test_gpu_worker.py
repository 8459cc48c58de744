"""GPU tier: the decode worker served in-process on CUDA (engine thread on the device) streams
the same greedy tokens as transformers on the same GPU, and the KV import copy (host staging ->
paged device KV) lands every token in its slot."""

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
from worker.paged_kv import scatter_tokens, token_slots
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_into_cuda_kv(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    staged = torch.randn(3, 2, 1, 45, 2, 24, generator=g).to(dtype)  # host staging
    kv = torch.zeros(3, 2, 11, 8, 2, 24, dtype=dtype, device="cuda")
    block_ids = [9, 2, 7, 1, 5, 10]
    scatter_tokens(kv, block_ids, 3, 45, staged)
    flat = kv.view(3, 2, -1, 2, 24)
    slots = token_slots(block_ids, 8, 3, 45, kv.device)
    assert torch.equal(flat[:, :, slots].cpu(), staged[:, :, 0, 3:45])
    assert int((flat != 0).any(dim=(0, 1, 3, 4)).sum()) == 42
