"""A step that raised ends the sequences that raise, not the worker.

`execute_isolating` runs one step through `ModelRunner.execute`. When that raises (a model,
sampler or grammar bug that one request's tokens or parameters reach), it runs the step's
chunks again one at a time: a chunk that raises on its own is a culprit and is reported, the
others' results are kept, so the step goes on without the culprits. It re-raises, and the
worker's engine loop then fails as before, when the engine itself is in doubt:

- the error is the device's (a CUDA error: the context is unusable afterwards);
- the step is tensor-parallel (the other ranks ran the step too and are not re-run here);
- `FATAL_STEPS_IN_A_ROW` steps in a row lost every chunk they held (a broken engine fails
  every request; a stream of bad requests is broken up by the good steps between them).

A family that cannot re-run a step (``ModelFamily.rerun_safe`` False: per-slot running state
that the failed step may have advanced) ends every sequence of a raised step with the error:
they cannot be told apart, and their slots are bound afresh by the next sequence admitted.

A re-run writes each chunk's KV at the same positions as the failed step did (the dense
families write state only there), so what the failed step left behind is overwritten. This
module never decides anything about a request beyond "its step raised".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model_runner import ModelRunner
from engine.sampler import RowState
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

# steps in a row in which every chunk raised: past this the engine, not a stream of bad
# requests, is taken to be broken, and the worker exits (its supervisor restarts it)
FATAL_STEPS_IN_A_ROW = 8


@dataclass
class StepResult:
    """What a step computed for the chunks that ran; ``raised``: request id -> why its step
    raised (those chunks did not run and must be ended)."""

    sched: SchedulerOutput                      # the step, without the chunks that raised
    sampled: dict[str, int]
    logprobs: dict[str, Any]
    prompt_logprobs: dict[str, Any]
    errors: dict[str, str]                      # rows no token could be drawn for (sampler)
    raised: dict[str, str] = field(default_factory=dict)


def is_device_error(exc: BaseException) -> bool:
    """An error after which the device cannot be trusted (CUDA's sticky errors)."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    text = str(exc)
    return "CUDA error" in text or "CUBLAS_STATUS" in text or "CUDNN_STATUS" in text


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0][:300] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class StepIsolator:
    """Runs steps on ``runner``; remembers how many steps in a row lost every chunk."""

    def __init__(self, runner: ModelRunner, *, rerun_safe: bool, tensor_parallel: bool) -> None:
        self._runner = runner
        self._rerun_safe = rerun_safe
        self._tensor_parallel = tensor_parallel
        self.failed_in_a_row = 0

    def _run(self, sched: SchedulerOutput, params: Mapping[str, SamplingParams],
             generators: Mapping[str, torch.Generator | None], rows: Mapping[str, RowState],
             matchers: Mapping[str, Any], prompts: Mapping[str, Sequence[int]]) -> StepResult:
        r = self._runner
        sampled = r.execute(sched, dict(params), dict(generators), dict(rows),
                            dict(matchers) or None, dict(prompts) or None)
        return StepResult(sched, sampled, dict(r.last_logprobs), dict(r.last_prompt_logprobs),
                          dict(r.last_errors))

    def execute(self, sched: SchedulerOutput, params: Mapping[str, SamplingParams],
                generators: Mapping[str, torch.Generator | None], rows: Mapping[str, RowState],
                matchers: Mapping[str, Any],
                prompts: Mapping[str, Sequence[int]]) -> StepResult:
        """The step's results; see the module docstring for when it raises instead."""
        try:
            result = self._run(sched, params, generators, rows, matchers, prompts)
        except Exception as exc:
            if is_device_error(exc) or self._tensor_parallel:
                raise
            result = self._isolate(exc, sched, params, generators, rows, matchers, prompts)
        self.failed_in_a_row = self.failed_in_a_row + 1 if not result.sched.chunks else 0
        if self.failed_in_a_row >= FATAL_STEPS_IN_A_ROW:
            raise RuntimeError(f"{self.failed_in_a_row} steps in a row raised for every "
                               f"sequence they ran (last: {next(iter(result.raised.values()))})")
        return result

    def _isolate(self, first: Exception, sched: SchedulerOutput,
                 params: Mapping[str, SamplingParams],
                 generators: Mapping[str, torch.Generator | None], rows: Mapping[str, RowState],
                 matchers: Mapping[str, Any],
                 prompts: Mapping[str, Sequence[int]]) -> StepResult:
        ids = [c.request_id for c in sched.chunks]
        log.warning("a step of %d sequence(s) raised %s; running them one at a time",
                    len(ids), describe(first))
        if len(ids) == 1 or not self._rerun_safe:
            return StepResult(SchedulerOutput([], sched.preempted, sched.admitted,
                                              sched.kv_loads), {}, {}, {}, {},
                              {rid: describe(first) for rid in ids})
        kept = []
        out = StepResult(sched, {}, {}, {}, {})
        for chunk in sched.chunks:
            rid = chunk.request_id
            alone = SchedulerOutput([chunk])

            def only(m: Mapping[str, Any], rid: str = rid) -> dict[str, Any]:
                return {rid: m[rid]} if rid in m else {}

            try:
                got = self._run(alone, only(params), only(generators), only(rows),
                                only(matchers), only(prompts))
            except Exception as exc:
                if is_device_error(exc):
                    raise
                out.raised[rid] = describe(exc)
                continue
            kept.append(chunk)
            out.sampled.update(got.sampled)
            out.logprobs.update(got.logprobs)
            out.prompt_logprobs.update(got.prompt_logprobs)
            out.errors.update(got.errors)
        out.sched = SchedulerOutput(kept, sched.preempted, sched.admitted, sched.kv_loads)
        return out
