"""GPU tier: decode steps replayed as CUDA graphs give the same greedy tokens as the same engine
stepping eagerly, and (fp32) as the PyTorch kernel path; no device allocation either way."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scoring import drain
from tests.engine.conftest import build_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(model, dtype: str, **kw) -> tuple[dict[str, list[int]], LLMEngine]:
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    weights = {k: v.to("cuda", getattr(torch, dtype)) for k, v in model.state_dict().items()}
    ec = EngineConfig(model="tiny", device="cuda", dtype=dtype, max_context=1024,
                      chunk_tokens=256, max_batch=8, block_size=16, strict_allocations=True, **kw)
    engine = LLMEngine(ec, cfg, weights)
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate([1, 5, 33, 100, 250, 7]):  # 6 sequences: graph size 8 with 2 pad rows
        engine.add_request(f"r{i}", torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    out = drain(engine)
    assert engine.stats().device_allocs_since_warmup == 0
    return out, engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_replay_equals_eager(family, dtype):
    model = build_tiny_model(family, hidden_size=256, intermediate_size=704,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             vocab_size=4096, num_hidden_layers=3)
    graphs, eng = _generate(model, dtype)
    assert eng.runner.num_graph_steps > 30
    eager, eng2 = _generate(model, dtype, cuda_graphs=False)
    assert eng2.runner.num_graph_steps == 0
    _assert_same_greedy(graphs, eager)
    if dtype == "float32":
        torch_path, _ = _generate(model, dtype, attention_backend="torch")
        _assert_same_greedy(graphs, torch_path)


def _assert_same_greedy(a: dict[str, list[int]], b: dict[str, list[int]]) -> None:
    """Greedy streams of a random tiny model are chaotic: a different reduction order (a graph
    pads 6 rows to 8, which changes the GEMM and the decode split) can flip a near-tied argmax
    and the streams part from there (seen on the H200 in fp32, from token 16). A broken graph
    input (wrong position, slot or block table) diverges at the first decode tokens; the exact
    check is ``test_graph_logits_equal_eager_logits``."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:4] == b[k][:4], (k, a[k], b[k])


def decode_step_logits(engine: LLMEngine, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6 added sequences' first decode step, replayed as a graph and run eagerly on the same
    KV (the other tensor-parallel ranks, if any, told to do each as well: their all-reduces must
    meet rank 0's). Returns (replayed, eager) logits."""
    engine.step()  # every prompt fits one 512-token chunk: each has its first token
    out = engine.scheduler.schedule()
    assert len(out.chunks) == 6 and all(c.num_tokens == 1 for c in out.chunks)
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.can_run(out.chunks)
    with torch.inference_mode():
        with runner.ws.scope():
            runner.tell("graph_step", out.chunks)
            replayed = runner.graphs.run(out.chunks).clone()
        with runner.ws.scope():
            runner.tell("forward", out.chunks, False)  # same KV writes as the replay
            batch = runner.build_batch(out.chunks)
            eager = runner.ws.take((6, vocab), torch.float32, caller="test.logits")
            runner.forward_logits(batch, runner.ws, eager)
            eager = eager.clone()
    return replayed, eager


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graph_logits_equal_eager_logits(family, dtype):
    """One decode step of 6 running sequences, replayed as a graph and run eagerly on the same
    KV cache: the logits agree to reduction-order rounding."""
    model = build_tiny_model(family, hidden_size=256, intermediate_size=704,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                             vocab_size=4096, num_hidden_layers=3)
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    weights = {k: v.to("cuda", getattr(torch, dtype)) for k, v in model.state_dict().items()}
    ec = EngineConfig(model="tiny", device="cuda", dtype=dtype, max_context=1024,
                      chunk_tokens=512, max_batch=8, block_size=16, strict_allocations=True)
    engine = LLMEngine(ec, cfg, weights)
    g = torch.Generator().manual_seed(4)
    for i, n in enumerate([1, 5, 33, 100, 250, 7]):
        engine.add_request(f"r{i}", torch.randint(0, 4096, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    replayed, eager = decode_step_logits(engine, cfg.vocab_size)
    # fp32: Triton's tl.dot runs fp32 inputs as TF32 and the decode split differs between 6
    # rows and the graph's 8, so ~1e-4 (measured on the H200: 1.3e-4 at most), not 1e-6.
    tol = 1e-3 if dtype == "float32" else 3e-2
    torch.testing.assert_close(replayed, eager, rtol=tol, atol=tol)
