"""Access control on a worker's gRPC server: the shared internal token and optional TLS.

``InternalTokenInterceptor`` answers UNAUTHENTICATED, before any servicer code runs, to every
call that does not carry ``authorization: Bearer <internal_token>`` metadata (the router sends
it, router/worker_client.py). ``grpc.health.v1`` stays open on purpose: orchestrators and
``deploy/healthcheck_grpc.py`` probe it without secrets, and it tells nothing but
SERVING / NOT_SERVING. ``server_credentials`` turns the worker's certificate and key files into
TLS credentials; ``warn_if_open`` says at start-up when a worker reachable from other hosts
checks no token.

This module never logs or echoes a token, compares tokens only in constant time
(``hmac.compare_digest``) and imports no torch.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

# Method-name prefixes served without a token.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_HINT = ("send `authorization: Bearer <token>` metadata with the workers' internal_token "
         "(router setting internal_token, env BULKHEAD_INTERNAL_TOKEN)")


class AccessError(ValueError):
    """An access setting cannot be used (a TLS file that cannot be read); names the setting."""


def token_problem(metadata: Sequence[tuple[str, Any]] | None, token: str) -> str:
    """Why ``metadata`` does not authorize a call to a worker whose token is ``token``
    ('' = it does). Never includes what was sent."""
    given = next((v for k, v in metadata or () if k == "authorization"), None)
    if given is None:
        return f"missing internal token: {_HINT}"
    if isinstance(given, bytes):
        given = given.decode(errors="replace")
    scheme, _, value = str(given).partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return f"malformed authorization metadata: {_HINT}"
    if not hmac.compare_digest(value.strip().encode(), token.encode()):
        return "wrong internal token: the router's internal_token differs from this worker's"
    return ""


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the shared token (UNAUTHENTICATED, with the reason)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise AccessError("internal_token: the interceptor needs a non-empty token")
        self._token = token
        self._logged: set[tuple[str, str]] = set()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        problem = token_problem(handler_call_details.invocation_metadata, self._token)
        return handler if not problem else self._refusal(handler, method, problem)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str,
                 problem: str) -> grpc.RpcMethodHandler:
        """A handler of the same shape as ``handler`` that only aborts."""

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            key = (context.peer(), problem.partition(":")[0])
            if key not in self._logged:  # once per peer and reason: a misconfigured router
                self._logged.add(key)    # polls every few seconds
                log.warning("refused %s from %s: %s", method, key[0], key[1])
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        serdes = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse, **serdes)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse, **serdes)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse, **serdes)
        return grpc.stream_stream_rpc_method_handler(refuse, **serdes)


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a worker whose internal token is ``token`` ('' = none)."""
    return [InternalTokenInterceptor(token)] if token else []


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, or None (plaintext) when neither is set."""
    if not cert_file and not key_file:
        return None
    if not cert_file or not key_file:
        raise AccessError("tls_cert_file / tls_key_file: give both (TLS on) or neither")
    pems = []
    for name, path in (("tls_key_file", key_file), ("tls_cert_file", cert_file)):
        try:
            pems.append(Path(path).read_bytes())
        except OSError as exc:
            raise AccessError(f"{name}: cannot read {path}: {exc.strerror or exc}") from exc
    return grpc.ssl_server_credentials([(pems[0], pems[1])])


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the port on this machine ('0.0.0.0', '::', a hostname or
    an interface address do not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, token: str, tls: bool) -> None:
    """Log, once at start-up, what a worker bound to ``host`` lets through."""
    if is_loopback(host):
        return
    if not token:
        log.warning("no internal_token and the gRPC server binds %s: anyone who can reach this "
                    "port can run requests on the worker; set BULKHEAD_INTERNAL_TOKEN on the "
                    "workers and the router", host)
    elif not tls:
        log.info("internal token checked, but gRPC on %s is plaintext: set tls_cert_file and "
                 "tls_key_file (router: worker_tls_ca_file) unless the network is trusted", host)
