"""GPU tier: DeepSeek-V4 decode replayed as CUDA graphs (the quantized tiny checkpoint of
test_deepseek_v4_quantized: FP8 projections, MXFP4 experts, awkward widths) gives the same
logits as the same step run eagerly, transformers' greedy tokens, and no device allocation
after warm-up; three sequences run in a graph of four (one pad row copying row 0)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, KernelChoices
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

from ._greedy import greedy_tokens
from .test_deepseek_v4_quantized import quantized  # noqa: F401  (the module's fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = (23, 9, 40)
NEW = 12


_DECODE = ["auto"]  # the loop the current test's engines run (set by the fixture)


@pytest.fixture(autouse=True, params=["unfused", "fused"])
def decode_loop(request) -> str:
    """Both decode layer loops, as the engine config's kernel choice (``_engine``)."""
    _DECODE[0] = request.param
    return request.param


def _engine(folder, **kw) -> LLMEngine:
    ec = EngineConfig(model=str(folder), device="cuda", dtype="float32", max_context=128,
                      chunk_tokens=64, max_batch=4, block_size=16, attn_tile_tokens=16,
                      strict_allocations=True, kernels=KernelChoices(decode=_DECODE[0]), **kw)
    return LLMEngine.from_config(ec)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    return greedy_tokens(engine, PROMPTS, NEW)


def test_v4_graphs_match_transformers_and_eager(quantized) -> None:  # noqa: F811
    folder, model, _ = quantized
    engine = _engine(folder)
    assert engine.runner.graphs is not None, "the quantized V4 family must capture graphs"
    graphs = _run(engine)
    assert engine.runner.num_graph_steps >= NEW - 2
    assert engine.stats().device_allocs_since_warmup == 0
    eager_engine = _engine(folder, cuda_graphs=False)
    assert eager_engine.runner.graphs is None
    eager = _run(eager_engine)
    g = torch.Generator().manual_seed(7)
    for i, n in enumerate(PROMPTS):
        ids = torch.randint(2, 97, (n,), generator=g)
        want = model.generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, n:].tolist()
        # TF32 in the kernels may part a near-tied stream late; a wrong slot, position or
        # table diverges at once
        assert graphs[f"r{i}"][:6] == want[:6], (i, graphs[f"r{i}"], want)
        assert graphs[f"r{i}"][:6] == eager[f"r{i}"][:6]


def test_v4_graph_logits_equal_eager_logits(quantized) -> None:  # noqa: F811
    folder, _, _ = quantized
    engine = _engine(folder)
    g = torch.Generator().manual_seed(8)
    for i, n in enumerate(PROMPTS):
        engine.add_request(f"r{i}", torch.randint(2, 97, (n,), generator=g).tolist(),
                           SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # a few graph steps: windows of rates 4 and 8 close
        engine.step()
    out = engine.scheduler.schedule()
    assert len(out.chunks) == 3 and all(c.num_tokens == 1 for c in out.chunks)
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.can_run(out.chunks)
    # A step is not idempotent (a closing window overwrites its block's overlap slice, which
    # the previous window's was): the eager step starts from a copy of the state before.
    state = [t.clone() for t in runner.kv.block_tensors() + runner.kv.slot_tensors()]
    with torch.inference_mode():
        with runner.ws.scope():
            runner.model.before_graph_step(runner.kv, out.chunks)
            replayed = runner.graphs.run(out.chunks).clone()
        for t, saved in zip(runner.kv.block_tensors() + runner.kv.slot_tensors(), state, strict=True):
            t.copy_(saved)
        for c in out.chunks:
            runner.kv.num_tokens[c.cache_slot] = c.start
        with runner.ws.scope():
            batch = runner.build_batch(out.chunks)
            eager = runner.ws.take((3, 97), torch.float32, caller="test.logits")
            runner.forward_logits(batch, runner.ws, eager)
            eager = eager.clone()
    torch.testing.assert_close(replayed, eager, rtol=1e-3, atol=1e-3)
