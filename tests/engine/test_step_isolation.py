"""A step that raises ends the sequence that raises, alone (engine/step_isolation.py): the others
of the same steps finish with the tokens they would have had without it, in prefill and in
decode. A device error, or a run of steps that fail for everything, still stops the engine.

The fault is injected by wrapping the tiny model's `forward` in this test (a token id that
makes it raise); nothing in the product can be told to raise."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from engine.errors import StepFailed
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_isolation import FATAL_STEPS_IN_A_ROW
from tests.engine.conftest import build_tiny_model
from tests.engine.test_engine_vs_transformers import make_engine

POISON = 77  # a token id whose presence in a step's input makes the wrapped forward raise
PLAIN = {"a": [5, 9, 17, 33, 60], "b": [8, 3, 21, 44, 2, 13, 90]}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    folder = tmp_path_factory.mktemp("qwen2-step-isolation")
    build_tiny_model("qwen2").save_pretrained(folder)
    return make_engine(folder, max_context=256, chunk_tokens=32, max_batch=4)


@contextmanager
def poisoned(engine: LLMEngine, error: str = "shape mismatch in a layer") -> Iterator[list]:
    """While open, a forward whose input holds POISON raises RuntimeError(error); yields the
    list of the inputs' sizes each raised forward saw."""
    model = engine.runner.model
    real = model.forward
    raised: list[int] = []

    def forward(batch, kv, ws):
        if bool((batch.input_ids == POISON).any()):
            raised.append(batch.num_seqs)
            raise RuntimeError(error)
        return real(batch, kv, ws)

    model.forward = forward
    try:
        yield raised
    finally:
        del model.forward


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], dict]]) -> dict:
    """Add every request, step until done; -> request id -> (tokens, last output)."""
    for rid, (prompt, kw) in requests.items():
        engine.add_request(rid, prompt, GREEDY, **kw)
    tokens = {rid: [] for rid in requests}
    last = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                last[o.request_id] = o
    return {rid: (tokens[rid], last[rid]) for rid in requests}


def test_a_prompt_whose_prefill_raises_ends_alone(engine: LLMEngine) -> None:
    quiet = run(engine, {rid: (p, {}) for rid, p in PLAIN.items()})
    with poisoned(engine) as raised:
        got = run(engine, {**{rid: (p, {}) for rid, p in PLAIN.items()},
                           "bad": ([4, POISON, 6], {})})
    assert raised[0] == 3 and raised[1:] == [1]  # the step of three, then "bad" run alone
    tokens, out = got["bad"]
    assert tokens == [] and out.finish_reason == "error"
    assert isinstance(out.error, StepFailed) and "raised RuntimeError: shape mismatch" in str(out.error)
    for rid in PLAIN:
        assert got[rid][0] == quiet[rid][0] and got[rid][1].finish_reason == "length"
    assert engine.stats().num_running == 0 and not engine.has_unfinished()


def test_a_sequence_whose_decode_step_raises_ends_alone(engine: LLMEngine) -> None:
    """A decode worker's sequence continues after the prefill worker's first token; that token
    (POISON here) is computed in its first step there, which raises among the others'."""
    quiet = run(engine, {rid: (p, {}) for rid, p in PLAIN.items()})
    with poisoned(engine) as raised:
        got = run(engine, {**{rid: (p, {}) for rid, p in PLAIN.items()},
                           "bad": ([4, 5, 6], {"first_token_id": POISON})})
    assert raised and raised[-1] == 1
    tokens, out = got["bad"]
    assert out.finish_reason == "error" and isinstance(out.error, StepFailed)
    for rid in PLAIN:
        assert got[rid][0] == quiet[rid][0]
    # the engine serves on
    again = run(engine, {"after": (PLAIN["a"], {})})
    assert again["after"][0] == quiet["a"][0]


def test_a_device_error_still_stops_the_engine(engine: LLMEngine) -> None:
    with poisoned(engine, "CUDA error: an illegal memory access was encountered"):
        engine.add_request("dev", [4, POISON], GREEDY)
        with pytest.raises(RuntimeError, match="CUDA error"):
            engine.step()
    engine.abort("dev")
    (out,) = engine.step()
    assert out.finish_reason == "abort" and not engine.has_unfinished()


def test_steps_that_fail_for_everything_stop_the_engine(engine: LLMEngine) -> None:
    """A broken engine fails every sequence: after FATAL_STEPS_IN_A_ROW such steps the step
    raises (the worker exits and is restarted) instead of failing requests forever."""
    model = engine.runner.model

    def broken(batch, kv, ws):
        raise ValueError("weights gone")

    model.forward = broken
    try:
        for i in range(FATAL_STEPS_IN_A_ROW - 1):
            engine.add_request(f"r{i}", PLAIN["a"], GREEDY)
            (out,) = engine.step()
            assert out.finish_reason == "error" and "weights gone" in str(out.error)
        engine.add_request("last", PLAIN["a"], GREEDY)
        with pytest.raises(RuntimeError, match=f"{FATAL_STEPS_IN_A_ROW} steps in a row"):
            engine.step()
    finally:
        del model.forward
        engine.abort("last")
        engine.step()
        engine._isolator.failed_in_a_row = 0


def test_a_family_that_cannot_rerun_a_step_ends_all_of_its_sequences(engine) -> None:
    engine._isolator._rerun_safe = False
    try:
        with poisoned(engine) as raised:
            got = run(engine, {"a": (PLAIN["a"], {}), "bad": ([4, POISON, 6], {})})
        assert raised == [2]  # not re-run
        assert all(out.finish_reason == "error" for _, out in got.values())
        assert isinstance(got["a"][1].error, StepFailed)
    finally:
        engine._isolator._rerun_safe = True
    assert run(engine, {"a": (PLAIN["a"], {})})["a"][1].finish_reason == "length"


def test_torch_names_its_device_errors() -> None:
    from engine.step_isolation import is_device_error

    assert not is_device_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    if hasattr(torch, "AcceleratorError"):
        assert issubclass(torch.AcceleratorError, RuntimeError)
