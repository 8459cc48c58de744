"""Typed errors the engine raises for things a user, a peer or a checkpoint can cause.

Each carries what a person needs to act: which field or tensor, which limit. Services map them
once at their edge (gRPC status, OpenAI error body). Programmer invariants use ``assert``.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """A checkpoint is unreadable, of an unknown architecture, or missing/mis-shaped tensors."""


class PlanError(EngineError):
    """The memory plan does not fit the device, or its parameters are inconsistent."""


class InvalidRequest(EngineError):
    """A request's parameters are out of range; ``field`` names the offending one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SequenceFailed(InvalidRequest):
    """One sequence cannot go on (its next token cannot be drawn: every token masked, the logits
    not finite, or its grammar refused what it sampled). That sequence ends alone with this
    error; the step, the rest of the batch and the worker go on."""


class StepFailed(EngineError):
    """The engine step running this sequence raised, and so did the sequence's chunk run on its
    own (engine/step_isolation.py): it ends alone with this error, the others go on. A server
    fault that this request reaches, not a bad request: retrying it elsewhere would fail too."""


class ContextLengthExceeded(InvalidRequest):
    """Prompt + max_tokens exceeds the longest context the fixed KV extent was planned for."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        super().__init__(
            f"this worker's maximum context length is {max_context} tokens; the request has "
            f"{num_prompt_tokens} prompt tokens and asks for {max_tokens} new tokens "
            f"({num_prompt_tokens + max_tokens} in all). Shorten the prompt or lower max_tokens.",
            field="messages",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_context = max_context


class QueueFull(EngineError):
    """The bounded waiting queue is full; the caller should retry later."""


class DuplicateRequest(EngineError):
    """A request id that is already running was added again."""


class WorkspaceExhausted(EngineError):
    """A scratch request exceeded the locked workspace: the plan under-counted ``caller``."""

    def __init__(self, caller: str, requested: int, available: int, capacity: int) -> None:
        super().__init__(
            f"workspace exhausted: {caller} asked for {requested} bytes with {available} of "
            f"{capacity} bytes left in the locked arena. This is a planning bug: the memory plan "
            f"did not count this buffer."
        )
        self.caller = caller
        self.requested = requested
        self.available = available
        self.capacity = capacity


class DeviceAllocationAfterLock(EngineError):
    """Strict mode: the device allocator took new memory after warm-up (CUDA only)."""
