"""Typed errors a worker raises for things a caller or a peer causes outside the engine: a
deadline that passed, a request aborted while it ran, an RPC sent to the wrong role, a store that
cannot answer. Engine errors (engine/errors.py) and these are turned into a gRPC status in one
place, ``worker.codec.status_of``; servicers raise, they never pick a status code themselves.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Base of every error a worker raises on purpose."""


class DeadlinePassed(WorkerError):
    """The request's deadline (``deadline_unix_s``) passed before or while it ran."""


class RequestAborted(WorkerError):
    """The request was aborted (Abort RPC or shutdown) before it produced its answer."""


class WrongRole(WorkerError):
    """An RPC that this worker's role does not serve (Generate on prefill, Prefill on decode)."""


class KVStoreUnavailable(WorkerError):
    """The KV store could not answer a call the RPC depends on (Lookup)."""


class NoTokenSampled(WorkerError):
    """The engine finished a request without sampling a token: a worker bug, never the input."""
