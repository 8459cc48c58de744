"""Typed router errors, their OpenAI-shaped bodies, and the one place gRPC status codes map to HTTP.

Everything a client or a worker can cause ends as an `ApiError`; its `body()` is the OpenAI error
shape ``{"error": {"message", "type", "param", "code"}}``.  This module must never log request
contents or secrets, and must never import torch or ``engine/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(eq=False)
class ApiError(Exception):
    """An error answered to the HTTP client."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}


def invalid_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(num_prompt: int, num_new: int, limit: int,
                            param: str = "messages") -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{num_prompt + num_new} tokens ({num_prompt} in the prompt, {num_new} for the "
        "completion). Please reduce the prompt or max_tokens.",
        "invalid_request_error", param, "context_length_exceeded")


def context_length_certainly_exceeded(min_prompt: int, num_new: int, limit: int,
                                      param: str) -> ApiError:
    """The prompt is over the context by its length alone (refused before tokenizing it)."""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your prompt alone is "
        f"at least {min_prompt} tokens long (from its length), with {num_new} for the "
        "completion. Please reduce the prompt or max_tokens.",
        "invalid_request_error", param, "context_length_exceeded")


def model_not_found(name: str, served: str) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist; this server serves '{served}'.",
                    "invalid_request_error", "model", "model_not_found")


def no_worker(role: str, retry_after_s: int, detail: str = "") -> ApiError:
    extra = f": {detail}" if detail else ""
    return ApiError(503, f"No {role} worker is available{extra}. Retry later.",
                    "service_unavailable", None, "no_worker_available", retry_after_s)


def queue_full(retry_after_s: int, detail: str = "") -> ApiError:
    extra = f" ({detail})" if detail else ""
    return ApiError(429, f"Every worker's queue is full{extra}. Retry later.",
                    "rate_limit_error", None, "queue_full", retry_after_s)


@dataclass(eq=False)
class WorkerCallError(Exception):
    """A worker RPC failed: which worker, in which phase, with which gRPC status."""

    address: str
    phase: str
    code: grpc.StatusCode
    details: str
    reached: bool = False   # the worker's handler had taken the call (proto ACCEPTED)

    def __str__(self) -> str:
        return f"worker {self.address} failed in phase {self.phase}: {self.code.name} {self.details}"


_FIELD_SUFFIX = re.compile(r" \(field ([A-Za-z_][\w.\[\]]*)\)$")


def from_worker_error(err: WorkerCallError, retry_after_s: int) -> ApiError:
    """The single mapping of worker gRPC status codes to HTTP answers."""
    code = err.code
    where = f"{err.phase} on worker {err.address}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, f"Worker queue full ({where}): {err.details}. Retry later.",
                        "rate_limit_error", None, "queue_full", retry_after_s)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, f"Worker unavailable ({where}): {err.details}. Retry later.",
                        "service_unavailable", None, "worker_unavailable", retry_after_s)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        detail = f": {err.details}" if err.details else "."
        return ApiError(504, f"Deadline exceeded in phase {where}{detail}", "timeout_error",
                        None, f"{err.phase}_timeout")
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
        return ApiError(400, f"The worker's memory plan cannot hold this request ({where}): "
                        f"{err.details}", "invalid_request_error", None,
                        "context_length_exceeded")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        # worker.codec.status_of ends the details with " (field NAME)" where the engine named one
        named = _FIELD_SUFFIX.search(err.details)
        details = err.details[:named.start()] if named else err.details
        return ApiError(400, f"Invalid request ({where}): {details}", "invalid_request_error",
                        named.group(1) if named else None, "invalid_argument")
    if code == grpc.StatusCode.CANCELLED:
        return ApiError(499, f"Request cancelled ({where}).", "cancelled", None, "cancelled")
    return ApiError(502, f"Worker error ({where}): {code.name} {err.details}", "server_error",
                    None, "worker_error")
